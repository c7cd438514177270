// Hooks of the six image loaders, unloads and function attributes: the driver call first, then
// the catalog (catalog.cpp) notes what was loaded.
#include "catalog.h"

using namespace ember;

namespace {
#define REAL_OR_FAIL(sym)                          \
  const Real* r = real();                          \
  if (r == nullptr || r->sym == nullptr) return kNoDriver

bool active() { return mode() != Mode::Off; }
}  // namespace

extern "C" {

EMBER_EXPORT CUresult cuModuleLoad(CUmodule* module, const char* fname) {
  REAL_OR_FAIL(cuModuleLoad);
  const CUresult rc = r->cuModuleLoad(module, fname);
  if (rc == CUDA_SUCCESS && active() && fname) catalog_note_load("cuModuleLoad", nullptr, fname, *module, nullptr, {}, {});
  return rc;
}

EMBER_EXPORT CUresult cuModuleLoadData(CUmodule* module, const void* image) {
  REAL_OR_FAIL(cuModuleLoadData);
  const CUresult rc = r->cuModuleLoadData(module, image);
  if (rc == CUDA_SUCCESS && active()) catalog_note_load("cuModuleLoadData", image, nullptr, *module, nullptr, {}, {});
  return rc;
}

EMBER_EXPORT CUresult cuModuleLoadDataEx(CUmodule* module, const void* image, unsigned int numOptions,
                                         CUjit_option* options, void** optionValues) {
  REAL_OR_FAIL(cuModuleLoadDataEx);
  const CUresult rc = r->cuModuleLoadDataEx(module, image, numOptions, options, optionValues);
  if (rc == CUDA_SUCCESS && active())
    catalog_note_load("cuModuleLoadDataEx", image, nullptr, *module, nullptr,
                      keep_jit_options(numOptions, options, optionValues), {});
  return rc;
}

EMBER_EXPORT CUresult cuModuleLoadFatBinary(CUmodule* module, const void* fatCubin) {
  REAL_OR_FAIL(cuModuleLoadFatBinary);
  const CUresult rc = r->cuModuleLoadFatBinary(module, fatCubin);
  if (rc == CUDA_SUCCESS && active())
    catalog_note_load("cuModuleLoadFatBinary", fatCubin, nullptr, *module, nullptr, {}, {});
  return rc;
}

EMBER_EXPORT CUresult cuLibraryLoadData(CUlibrary* library, const void* code, CUjit_option* jitOptions,
                                        void** jitOptionsValues, unsigned int numJitOptions,
                                        CUlibraryOption* libraryOptions, void** libraryOptionValues,
                                        unsigned int numLibraryOptions) {
  REAL_OR_FAIL(cuLibraryLoadData);
  const CUresult rc = r->cuLibraryLoadData(library, code, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                                           libraryOptionValues, numLibraryOptions);
  if (rc == CUDA_SUCCESS && active())
    catalog_note_load("cuLibraryLoadData", code, nullptr, nullptr, *library,
                      keep_jit_options(numJitOptions, jitOptions, jitOptionsValues),
                      keep_library_options(numLibraryOptions, libraryOptions, libraryOptionValues));
  return rc;
}

EMBER_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary* library, const char* fileName, CUjit_option* jitOptions,
                                            void** jitOptionsValues, unsigned int numJitOptions,
                                            CUlibraryOption* libraryOptions, void** libraryOptionValues,
                                            unsigned int numLibraryOptions) {
  REAL_OR_FAIL(cuLibraryLoadFromFile);
  const CUresult rc = r->cuLibraryLoadFromFile(library, fileName, jitOptions, jitOptionsValues, numJitOptions,
                                               libraryOptions, libraryOptionValues, numLibraryOptions);
  if (rc == CUDA_SUCCESS && active() && fileName)
    catalog_note_load("cuLibraryLoadFromFile", nullptr, fileName, nullptr, *library,
                      keep_jit_options(numJitOptions, jitOptions, jitOptionsValues),
                      keep_library_options(numLibraryOptions, libraryOptions, libraryOptionValues));
  return rc;
}

EMBER_EXPORT CUresult cuModuleUnload(CUmodule hmod) {
  REAL_OR_FAIL(cuModuleUnload);
  if (active()) catalog_note_unload(hmod, nullptr);
  return r->cuModuleUnload(hmod);
}

EMBER_EXPORT CUresult cuLibraryUnload(CUlibrary library) {
  REAL_OR_FAIL(cuLibraryUnload);
  if (active()) catalog_note_unload(nullptr, library);
  return r->cuLibraryUnload(library);
}

EMBER_EXPORT CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value) {
  REAL_OR_FAIL(cuFuncSetAttribute);
  const CUresult rc = r->cuFuncSetAttribute(hfunc, attrib, value);
  if (rc == CUDA_SUCCESS && active()) catalog_note_attribute(hfunc, nullptr, static_cast<int>(attrib), value);
  return rc;
}

EMBER_EXPORT CUresult cuKernelSetAttribute(CUfunction_attribute attrib, int val, CUkernel kernel, CUdevice dev) {
  REAL_OR_FAIL(cuKernelSetAttribute);
  const CUresult rc = r->cuKernelSetAttribute(attrib, val, kernel, dev);
  if (rc == CUDA_SUCCESS && active()) catalog_note_attribute(nullptr, kernel, static_cast<int>(attrib), val);
  return rc;
}

}  // extern "C"
