// The kernel-binary catalog: every image the process loads (content hash, kind, options,
// kernels, per-function attributes), the reverse lookup CUfunction/CUkernel -> (hash, name),
// and proactive loading of an archive's images at LOAD (worker threads, in execution order).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "images.h"

namespace ember {

using Options = std::vector<std::pair<int, int64_t>>;
// {"jit": {opt: value}, "library": {opt: value}} (integer keys and values; NULL or "" is empty).
bool parse_options(const char* js, Options* jit, Options* lib);

// Called by the loader hooks after the driver loaded an image successfully.
// file: path for cuModuleLoad / cuLibraryLoadFromFile (image == nullptr then).
void catalog_note_load(const char* api, const void* image, const char* file, CUmodule mod, CUlibrary lib,
                       const Options& jit, const Options& libopts);
void catalog_note_unload(CUmodule mod, CUlibrary lib);
void catalog_note_attribute(CUfunction func, CUkernel kern, int attrib, int value);

// Keeps only options that carry plain values (drops log buffers, host tables, outputs).
Options keep_jit_options(unsigned n, const CUjit_option* opts, void* const* values);
Options keep_library_options(unsigned n, const CUlibraryOption* opts, void* const* values);

std::string catalog_json();
int catalog_lookup(uint64_t func, uint64_t kern, std::string* hash, std::string* name);
int catalog_image_bytes(const std::string& hash, const std::vector<uint8_t>** bytes);
struct PreloadItem {
  std::string hash;
  const uint8_t* data = nullptr;  // the caller's bytes, copied before catalog_preload returns
  size_t size = 0;
  Options jit, lib;
};
int catalog_preload(std::vector<PreloadItem> items);
int catalog_function(const std::string& hash, const std::string& name, uint64_t* func);
std::string catalog_stats_json();

}  // namespace ember
