// The C control API (include/ember.h): thin, argument-checking shims over allocator.cpp and
// catalog.cpp. Python reaches it through ctypes (ember/native.py).
#include <algorithm>
#include <cstring>

#include "allocator.h"
#include "catalog.h"
#include "ember.h"

using namespace ember;

namespace ember {
int set_mode_checked(int m);
}

namespace {

int fail(int code, const std::string& msg) {
  set_last_error(msg);
  return code;
}

int copy_out(const std::string& s, char* buf, size_t cap, size_t* needed) {
  if (needed) *needed = s.size();
  if (buf == nullptr || cap < s.size()) return EMBER_ERANGE;
  memcpy(buf, s.data(), s.size());
  return EMBER_OK;
}

void copy_str(const std::string& s, char* buf, size_t cap) {
  if (buf == nullptr || cap == 0) return;
  const size_t n = std::min(cap - 1, s.size());
  memcpy(buf, s.data(), n);
  buf[n] = '\0';
}


}  // namespace

namespace ember {

// {"jit": {"7": 4}, "library": {"1": 1}}: a deliberately small parser for integer maps.
bool parse_options(const char* js, Options* jit, Options* lib) {
  if (js == nullptr || *js == '\0') return true;
  const std::string s(js);
  for (auto [key, out] : {std::pair<const char*, Options*>{"\"jit\"", jit}, {"\"library\"", lib}}) {
    size_t at = s.find(key);
    if (at == std::string::npos) continue;
    at = s.find('{', at);
    const size_t end = s.find('}', at);
    if (at == std::string::npos || end == std::string::npos) return false;
    const std::string body = s.substr(at + 1, end - at - 1);
    const char* p = body.c_str();
    while (*p) {
      while (*p == ' ' || *p == ',' || *p == '\n' || *p == '\t') ++p;
      if (!*p) break;
      if (*p != '"') return false;
      char* e = nullptr;
      const long k = strtol(p + 1, &e, 10);
      if (e == p + 1 || *e != '"') return false;
      p = e + 1;
      while (*p == ' ') ++p;
      if (*p != ':') return false;
      const long long v = strtoll(p + 1, &e, 10);
      if (e == p + 1) return false;
      out->emplace_back(static_cast<int>(k), static_cast<int64_t>(v));
      p = e;
    }
  }
  return true;
}

}  // namespace ember

extern "C" {

EMBER_EXPORT int ember_abi_version(void) { return 1; }

EMBER_EXPORT int ember_get_mode(void) { return static_cast<int>(mode()); }

EMBER_EXPORT int ember_set_mode(int m) { return set_mode_checked(m); }

EMBER_EXPORT int ember_region(uint64_t* base, uint64_t* size, uint64_t* heap_size) {
  return region_info(base, size, heap_size);
}

EMBER_EXPORT int ember_arm(void) { return region_arm(); }
EMBER_EXPORT int ember_capture_begin(void) { return region_capture_begin(); }
EMBER_EXPORT int ember_capture_end(void) { return region_capture_end(); }

EMBER_EXPORT int ember_export_alloc_log(char* buf, size_t cap, size_t* needed) {
  return copy_out(region_export_log(), buf, cap, needed);
}

EMBER_EXPORT int ember_import_alloc_log(const char* data, size_t len) { return region_import_log(data, len); }

EMBER_EXPORT int ember_replay_window(void) { return region_replay_window(); }

EMBER_EXPORT int ember_replay_blockers(char* buf, size_t cap) {
  std::string first;
  const int n = region_replay_blockers(&first);
  if (buf != nullptr && cap > 0) copy_str(first, buf, cap);
  return n;
}

EMBER_EXPORT int ember_divergence(char* buf, size_t cap) {
  std::string msg;
  if (!region_divergence(&msg)) return 0;
  copy_str(msg, buf, cap);
  return 1;
}

EMBER_EXPORT int ember_last_error(char* buf, size_t cap) {
  copy_str(last_error(), buf, cap);
  return EMBER_OK;
}

EMBER_EXPORT int ember_catalog_json(char* buf, size_t cap, size_t* needed) {
  return copy_out(catalog_json(), buf, cap, needed);
}

EMBER_EXPORT int ember_lookup(uint64_t func, uint64_t kern, char* hash, size_t hash_cap, char* name,
                              size_t name_cap) {
  if (func == 0 && kern == 0) return fail(EMBER_EINVAL, "lookup: func and kern are both 0");
  std::string h, n;
  const int rc = catalog_lookup(func, kern, &h, &n);
  if (rc != EMBER_OK) return rc;
  if (hash_cap <= h.size() || name_cap <= n.size()) return fail(EMBER_ERANGE, "lookup: buffer too small");
  copy_str(h, hash, hash_cap);
  copy_str(n, name, name_cap);
  return EMBER_OK;
}

EMBER_EXPORT int ember_image_bytes(const char* hash, void* buf, size_t cap, size_t* needed) {
  if (hash == nullptr) return fail(EMBER_EINVAL, "image_bytes: no hash");
  const std::vector<uint8_t>* bytes = nullptr;
  if (catalog_image_bytes(hash, &bytes) != EMBER_OK)
    return fail(EMBER_ENOTFOUND, std::string("image_bytes: no bytes for image ") + hash +
                                     " (bytes are kept in save mode only)");
  if (needed) *needed = bytes->size();
  if (buf == nullptr || cap < bytes->size()) return EMBER_ERANGE;
  memcpy(buf, bytes->data(), bytes->size());
  return EMBER_OK;
}

EMBER_EXPORT int ember_preload(size_t n, const char* const* hashes, const void* const* data, const size_t* sizes,
                               const char* const* options_json) {
  if (n > 0 && (hashes == nullptr || data == nullptr || sizes == nullptr))
    return fail(EMBER_EINVAL, "preload: missing arrays");
  std::vector<PreloadItem> items(n);
  for (size_t i = 0; i < n; ++i) {
    if (hashes[i] == nullptr || data[i] == nullptr || sizes[i] == 0 || sizes[i] > kMaxImage)
      return fail(EMBER_EINVAL, "preload: image " + std::to_string(i) + " is empty or invalid");
    items[i].hash = hashes[i];
    items[i].data = static_cast<const uint8_t*>(data[i]);
    items[i].size = sizes[i];
    if (!parse_options(options_json ? options_json[i] : nullptr, &items[i].jit, &items[i].lib))
      return fail(EMBER_EFORMAT, "preload: malformed options for image " + std::to_string(i));
  }
  const int rc = catalog_preload(std::move(items));
  if (rc == EMBER_EFORMAT) set_last_error("preload: some images did not match their hash and were skipped");
  if (rc == EMBER_ENODRIVER) set_last_error("preload: no CUDA driver");
  return rc;
}

EMBER_EXPORT int ember_function(const char* hash, const char* name, uint64_t* func) {
  if (hash == nullptr || name == nullptr || func == nullptr) return fail(EMBER_EINVAL, "function: null argument");
  return catalog_function(hash, name, func);
}

EMBER_EXPORT int ember_stats_json(char* buf, size_t cap, size_t* needed) {
  std::string s = region_stats_json();  // an object left open for the catalog's part
  s += ",\"catalog\":" + catalog_stats_json() + "}";
  return copy_out(s, buf, cap, needed);
}

EMBER_EXPORT int ember_image_size(const void* image, size_t limit, int* kind, size_t* size) {
  if (kind == nullptr || size == nullptr) return fail(EMBER_EINVAL, "image_size: null output");
  const ImageSpan span = size_image(image, limit);
  *kind = static_cast<int>(span.outer == ImageKind::Wrapper ? ImageKind::Wrapper : span.kind);
  *size = span.size;
  if (span.kind == ImageKind::Unknown) return fail(EMBER_EFORMAT, "image_size: " + span.error);
  return EMBER_OK;
}

EMBER_EXPORT int ember_hash_hex(const void* data, size_t len, char* out, size_t cap) {
  if ((data == nullptr && len > 0) || out == nullptr) return fail(EMBER_EINVAL, "hash_hex: null argument");
  const std::string h = hash_hex(data, len);
  if (cap <= h.size()) return EMBER_ERANGE;
  copy_str(h, out, cap);
  return EMBER_OK;
}

}  // extern "C"
