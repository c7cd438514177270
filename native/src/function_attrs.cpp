// ember_functions: LOAD's kernel lookups in one call. Each kernel's CUfunction comes from the
// catalog (waiting for its own image only, as ember_function), then the function attributes SAVE
// recorded are set where the loaded function differs. One call per graph being prepared instead
// of ~8 driver calls per kernel from Python, each of which waited for the GIL again while a cold
// pod's model build held it (H100: 0.5-0.9 s of lookups and 0.1-0.55 s of attributes per LOAD).
#include <cstring>
#include <string>

#include "catalog.h"
#include "common.h"
#include "ember.h"

using namespace ember;

namespace {

// The order of ember.h's EMBER_FUNC_ATTRS values per kernel.
constexpr CUfunction_attribute kAttrs[EMBER_FUNC_ATTRS] = {
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH,        CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH,        CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
};

int apply(const Real* r, CUfunction f, const int32_t* want, const char* name) {
  for (int a = 0; a < EMBER_FUNC_ATTRS; ++a) {
    if (want[a] < 0) continue;  // leave it as loaded
    int have = 0;
    if (r->cuFuncGetAttribute && r->cuFuncGetAttribute(&have, kAttrs[a], f) == CUDA_SUCCESS && have == want[a])
      continue;
    const CUresult rc = r->cuFuncSetAttribute ? r->cuFuncSetAttribute(f, kAttrs[a], want[a]) : kNoDriver;
    if (rc != CUDA_SUCCESS) {
      set_last_error(strprintf("function: cuFuncSetAttribute(%d = %d) of %s failed: CUresult %d",
                               static_cast<int>(kAttrs[a]), want[a], name, static_cast<int>(rc)));
      return EMBER_EDRIVER;
    }
  }
  return EMBER_OK;
}

}  // namespace

extern "C" EMBER_EXPORT int ember_functions(size_t n, const char* const* hashes, const char* const* names,
                                            const int32_t* attrs, uint64_t* funcs, size_t* failed) {
  if (n > 0 && (hashes == nullptr || names == nullptr || attrs == nullptr || funcs == nullptr)) {
    set_last_error("function: missing arrays");
    return EMBER_EINVAL;
  }
  const Real* r = real();
  if (r == nullptr) {
    set_last_error("function: no CUDA driver");
    return EMBER_ENODRIVER;
  }
  for (size_t i = 0; i < n; ++i) {
    if (failed) *failed = i;
    if (hashes[i] == nullptr || names[i] == nullptr) {
      set_last_error("function: null name");
      return EMBER_EINVAL;
    }
    int rc = catalog_function(hashes[i], names[i], &funcs[i]);
    if (rc == EMBER_OK) rc = apply(r, reinterpret_cast<CUfunction>(funcs[i]), attrs + EMBER_FUNC_ATTRS * i, names[i]);
    if (rc != EMBER_OK) return rc;
  }
  return EMBER_OK;
}
