// The kernel-binary catalog (policy; the loader hooks are in module_hooks.cpp).
#include "catalog.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "ember.h"

namespace ember {

namespace {

enum class Load : int { None, Queued, Loading, Loaded, Failed };
const char* load_name(Load l) {
  static const char* n[] = {"none", "queued", "loading", "loaded", "failed"};
  return n[static_cast<int>(l)];
}

struct Image {
  std::string hash, api, file;
  std::vector<std::string> linked_from;  // v2 wrappers: hashes of the inputs linked at SAVE
  ImageKind kind = ImageKind::Unknown, outer = ImageKind::Unknown;
  int wrapper_version = 0;
  size_t size = 0;
  uint64_t order = 0;
  std::vector<uint8_t> bytes;  // SAVE: a private copy; LOAD: the preloaded image
  bool have_bytes = false;
  Options jit, lib;
  std::vector<CUmodule> modules;
  std::vector<CUlibrary> libraries;
  std::vector<std::string> kernels;
  bool enumerated = false;
  std::map<std::string, std::map<int, int>> attributes;  // kernel -> attribute -> value
  Load load = Load::None;
  uint64_t load_start_ns = 0, load_ns = 0;  // a preload's cuLibraryLoadData
  CUlibrary own_library = nullptr;  // loaded by ember (preload / function())
  std::string load_error;
};

struct Catalog {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::unique_ptr<Image>> images;
  std::map<std::string, Image*> by_hash;
  std::map<CUmodule, Image*> by_module;
  std::map<CUlibrary, Image*> by_library;
  std::deque<Image*> queue;
  int workers = 0;
  uint64_t loads = 0, unsized = 0, preloaded = 0, preload_failed = 0;
  uint64_t ns_hash = 0, ns_preload = 0, ns_wait = 0, ns_function = 0;
  uint64_t preload_t0 = 0;  // the first preload call (the origin of each load's start)
};

Catalog& the_catalog() {
  static Catalog* c = new Catalog();
  return *c;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\') { o += '\\'; o += static_cast<char>(ch); }
    else if (ch < 0x20 || ch >= 0x7f) o += strprintf("\\u%04x", ch);
    else o += static_cast<char>(ch);
  }
  return o;
}

bool read_file(const char* path, std::vector<uint8_t>* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  f.seekg(0, std::ios::end);
  const std::streamoff n = f.tellg();
  if (n <= 0 || static_cast<uint64_t>(n) > kMaxImage) return false;
  out->resize(static_cast<size_t>(n));
  f.seekg(0);
  return static_cast<bool>(f.read(reinterpret_cast<char*>(out->data()), n));
}

Image* intern(Catalog& c, const std::string& hash) {
  auto it = c.by_hash.find(hash);
  if (it != c.by_hash.end()) return it->second;
  c.images.push_back(std::make_unique<Image>());
  Image* im = c.images.back().get();
  im->hash = hash;
  im->order = c.images.size() - 1;
  c.by_hash[hash] = im;
  return im;
}

void enumerate(Image* im) {
  if (im->enumerated) return;
  const Real* r = real();
  if (r == nullptr) return;
  std::vector<std::string> names;
  if (!im->libraries.empty() || im->own_library) {
    CUlibrary lib = im->own_library ? im->own_library : im->libraries.front();
    unsigned n = 0;
    if (!r->cuLibraryGetKernelCount || r->cuLibraryGetKernelCount(&n, lib) != CUDA_SUCCESS) return;
    std::vector<CUkernel> ks(n);
    if (n && r->cuLibraryEnumerateKernels(ks.data(), n, lib) != CUDA_SUCCESS) return;
    for (CUkernel k : ks) {
      const char* name = nullptr;
      if (r->cuKernelGetName && r->cuKernelGetName(&name, k) == CUDA_SUCCESS && name) names.emplace_back(name);
    }
  } else if (!im->modules.empty()) {
    unsigned n = 0;
    CUmodule mod = im->modules.front();
    if (!r->cuModuleGetFunctionCount || r->cuModuleGetFunctionCount(&n, mod) != CUDA_SUCCESS) return;
    std::vector<CUfunction> fs(n);
    if (n && r->cuModuleEnumerateFunctions(fs.data(), n, mod) != CUDA_SUCCESS) return;
    for (CUfunction f : fs) {
      const char* name = nullptr;
      if (r->cuFuncGetName && r->cuFuncGetName(&name, f) == CUDA_SUCCESS && name) names.emplace_back(name);
    }
  } else {
    return;
  }
  im->kernels = std::move(names);
  im->enumerated = true;
}

// Loads an image's bytes as a library (context-independent). Caller does NOT hold the lock.
CUresult load_library_bytes(Image* im, CUlibrary* out) {
  const Real* r = real();
  if (r == nullptr || r->cuLibraryLoadData == nullptr) return kNoDriver;
  if (r->cuInit) r->cuInit(0);
  std::vector<CUjit_option> jo;
  std::vector<void*> jv;
  for (const auto& [k, v] : im->jit) {
    jo.push_back(static_cast<CUjit_option>(k));
    jv.push_back(reinterpret_cast<void*>(static_cast<intptr_t>(v)));
  }
  std::vector<CUlibraryOption> lo;
  std::vector<void*> lv;
  for (const auto& [k, v] : im->lib) {
    lo.push_back(static_cast<CUlibraryOption>(k));
    lv.push_back(reinterpret_cast<void*>(static_cast<intptr_t>(v)));
  }
  return r->cuLibraryLoadData(out, im->bytes.data(), jo.data(), jv.data(), static_cast<unsigned>(jo.size()),
                              lo.data(), lv.data(), static_cast<unsigned>(lo.size()));
}

void worker() {
  Catalog& c = the_catalog();
  for (;;) {
    Image* im = nullptr;
    {
      std::lock_guard<std::mutex> g(c.mu);
      if (c.queue.empty()) {
        c.workers--;
        c.cv.notify_all();
        return;
      }
      im = c.queue.front();
      c.queue.pop_front();
      im->load = Load::Loading;
    }
    const uint64_t t0 = now_ns();
    CUlibrary lib = nullptr;
    const CUresult rc = load_library_bytes(im, &lib);
    std::lock_guard<std::mutex> g(c.mu);
    im->load_start_ns = t0;
    im->load_ns = now_ns() - t0;
    c.ns_preload += im->load_ns;
    if (rc == CUDA_SUCCESS) {
      im->own_library = lib;
      c.by_library[lib] = im;
      im->load = Load::Loaded;
      c.preloaded++;
    } else {
      im->load = Load::Failed;
      im->load_error = strprintf("cuLibraryLoadData: CUresult %d", static_cast<int>(rc));
      c.preload_failed++;
      EMBER_LOG(Warn, "Preloading image %s failed: %s", im->hash.c_str(), im->load_error.c_str());
    }
    c.cv.notify_all();
  }
}

// SAVE, version-2 wrapper: link its fatbin with the listed ones (cuLink*) into one cubin, so
// that LOAD can load a single image. Returns false (and the caller keeps the unlinked fatbin) if
// anything fails.
bool prelink(const void* wrapper, const std::vector<uint8_t>& own, std::vector<uint8_t>* cubin,
             std::vector<std::string>* inputs) {
  const Real* r = real();
  if (!r || !r->cuLinkCreate_v2 || !r->cuLinkAddData_v2 || !r->cuLinkComplete || !r->cuLinkDestroy) return false;
  std::vector<ImageSpan> list;
  if (!wrapper_link_list(wrapper, &list)) return false;
  std::vector<std::vector<uint8_t>> parts(1, own);
  for (const ImageSpan& sp : list) {
    parts.emplace_back();
    if (!copy_image(sp, &parts.back())) return false;
  }
  CUlinkState st = nullptr;
  if (r->cuLinkCreate_v2(0, nullptr, nullptr, &st) != CUDA_SUCCESS) return false;
  bool ok = true;
  inputs->clear();
  for (auto& part : parts) {
    const ImageSpan sp = size_image(part.data(), part.size());
    const CUjitInputType type = sp.kind == ImageKind::Elf ? CU_JIT_INPUT_CUBIN
                                : sp.kind == ImageKind::Ptx ? CU_JIT_INPUT_PTX : CU_JIT_INPUT_FATBINARY;
    inputs->push_back(hash_hex(part.data(), part.size()));
    if (r->cuLinkAddData_v2(st, type, part.data(), part.size(), "ember", 0, nullptr, nullptr) != CUDA_SUCCESS) {
      ok = false;
      break;
    }
  }
  void* out = nullptr;
  size_t n = 0;
  if (ok && (r->cuLinkComplete(st, &out, &n) != CUDA_SUCCESS || out == nullptr || n == 0)) ok = false;
  if (ok) cubin->assign(static_cast<const uint8_t*>(out), static_cast<const uint8_t*>(out) + n);
  r->cuLinkDestroy(st);  // owns `out`: copied above
  return ok;
}

}  // namespace

Options keep_jit_options(unsigned n, const CUjit_option* opts, void* const* values) {
  Options out;
  if (opts == nullptr || values == nullptr) return out;
  for (unsigned i = 0; i < n; ++i) {
    switch (opts[i]) {
      case CU_JIT_WALL_TIME: case CU_JIT_INFO_LOG_BUFFER: case CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES:
      case CU_JIT_ERROR_LOG_BUFFER: case CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES: case CU_JIT_GLOBAL_SYMBOL_NAMES:
      case CU_JIT_GLOBAL_SYMBOL_ADDRESSES: case CU_JIT_GLOBAL_SYMBOL_COUNT: case CU_JIT_REFERENCED_KERNEL_NAMES:
      case CU_JIT_REFERENCED_KERNEL_COUNT: case CU_JIT_REFERENCED_VARIABLE_NAMES:
      case CU_JIT_REFERENCED_VARIABLE_COUNT:
        break;  // host pointers or outputs
      default:
        out.emplace_back(static_cast<int>(opts[i]), static_cast<int64_t>(reinterpret_cast<intptr_t>(values[i])));
    }
  }
  return out;
}

Options keep_library_options(unsigned n, const CUlibraryOption* opts, void* const* values) {
  Options out;
  if (opts == nullptr || values == nullptr) return out;
  for (unsigned i = 0; i < n; ++i)
    if (opts[i] != CU_LIBRARY_HOST_UNIVERSAL_FUNCTION_AND_DATA_TABLE)
      out.emplace_back(static_cast<int>(opts[i]), static_cast<int64_t>(reinterpret_cast<intptr_t>(values[i])));
  return out;
}

void catalog_note_load(const char* api, const void* image, const char* file, CUmodule mod, CUlibrary lib,
                       const Options& jit, const Options& libopts) {
  Catalog& c = the_catalog();
  const uint64_t t0 = now_ns();
  std::vector<uint8_t> bytes;
  ImageSpan span;
  if (file != nullptr) {
    if (!read_file(file, &bytes)) {
      EMBER_LOG(Warn, "%s(%s): could not read the file to catalog it", api, file);
      std::lock_guard<std::mutex> g(c.mu);
      c.unsized++;
      return;
    }
    span = size_image(bytes.data(), bytes.size());
    if (span.kind == ImageKind::Unknown) span.kind = ImageKind::Elf;  // files: keep whatever bytes they hold
    span.data = bytes.data();
    span.size = bytes.size();
  } else {
    span = size_image(image, 0);
    if (span.kind == ImageKind::Unknown || !copy_image(span, &bytes)) {
      EMBER_LOG(Warn, "%s: could not size the image (%s); it is not catalogued", api, span.error.c_str());
      std::lock_guard<std::mutex> g(c.mu);
      c.unsized++;
      return;
    }
  }
  std::vector<std::string> linked_from;
  if (span.wrapper_version == 2 && mode() == Mode::Save) {
    std::vector<uint8_t> cubin;
    if (prelink(image, bytes, &cubin, &linked_from)) {
      bytes = std::move(cubin);
      span.kind = ImageKind::Elf;
    } else {
      linked_from.clear();
      EMBER_LOG(Warn, "%s: could not prelink a version-2 fatbin wrapper; its image alone may not load", api);
    }
  }
  const std::string hash = hash_hex(bytes.data(), bytes.size());
  std::lock_guard<std::mutex> g(c.mu);
  c.ns_hash += now_ns() - t0;
  Image* im = intern(c, hash);
  if (im->api.empty()) {
    im->api = api;
    im->file = file ? file : "";
    im->kind = span.kind;
    im->outer = span.outer;
    im->wrapper_version = span.wrapper_version;
    im->size = bytes.size();
    im->jit = jit;
    im->lib = libopts;
    im->linked_from = std::move(linked_from);
  }
  if (mode() == Mode::Save && !im->have_bytes) {
    im->bytes = std::move(bytes);
    im->have_bytes = true;
  }
  if (mod) {
    im->modules.push_back(mod);
    c.by_module[mod] = im;
  }
  if (lib) {
    im->libraries.push_back(lib);
    c.by_library[lib] = im;
  }
  c.loads++;
  EMBER_LOG(Debug, "%s: image %s (%s, %zu bytes)", api, hash.c_str(), image_kind_name(im->kind), im->size);
}

void catalog_note_unload(CUmodule mod, CUlibrary lib) {
  Catalog& c = the_catalog();
  std::lock_guard<std::mutex> g(c.mu);
  if (mod) {
    auto it = c.by_module.find(mod);
    if (it != c.by_module.end()) {
      auto& v = it->second->modules;
      v.erase(std::remove(v.begin(), v.end(), mod), v.end());
      c.by_module.erase(it);
    }
  }
  if (lib) {
    auto it = c.by_library.find(lib);
    if (it != c.by_library.end()) {
      auto& v = it->second->libraries;
      v.erase(std::remove(v.begin(), v.end(), lib), v.end());
      if (it->second->own_library == lib) it->second->own_library = nullptr;
      c.by_library.erase(it);
    }
  }
}

// Finds the image of a function or kernel handle (caller holds the lock).
static Image* find_image(Catalog& c, uint64_t func, uint64_t kern, std::string* name) {
  const Real* r = real();
  if (r == nullptr) return nullptr;
  const char* nm = nullptr;
  if (kern != 0 && r->cuKernelGetLibrary) {
    CUlibrary lib = nullptr;
    auto k = reinterpret_cast<CUkernel>(kern);
    if (r->cuKernelGetLibrary(&lib, k) == CUDA_SUCCESS) {
      auto it = c.by_library.find(lib);
      if (it != c.by_library.end() && r->cuKernelGetName && r->cuKernelGetName(&nm, k) == CUDA_SUCCESS && nm) {
        *name = nm;
        return it->second;
      }
    }
  }
  if (func != 0 && r->cuFuncGetModule) {
    auto f = reinterpret_cast<CUfunction>(func);
    CUmodule mod = nullptr;
    if (r->cuFuncGetModule(&mod, f) != CUDA_SUCCESS) return nullptr;
    Image* im = nullptr;
    auto it = c.by_module.find(mod);
    if (it != c.by_module.end()) {
      im = it->second;
    } else if (r->cuLibraryGetModule) {
      // A library's function in this context: the library's module is created per context.
      for (auto& [lib, cand] : c.by_library) {
        CUmodule m = nullptr;
        if (r->cuLibraryGetModule(&m, lib) == CUDA_SUCCESS && m == mod) {
          im = cand;
          break;
        }
      }
    }
    if (im && r->cuFuncGetName && r->cuFuncGetName(&nm, f) == CUDA_SUCCESS && nm) {
      *name = nm;
      return im;
    }
  }
  return nullptr;
}

void catalog_note_attribute(CUfunction func, CUkernel kern, int attrib, int value) {
  Catalog& c = the_catalog();
  std::lock_guard<std::mutex> g(c.mu);
  std::string name;
  Image* im = find_image(c, reinterpret_cast<uint64_t>(func), reinterpret_cast<uint64_t>(kern), &name);
  if (im) im->attributes[name][attrib] = value;
}

int catalog_lookup(uint64_t func, uint64_t kern, std::string* hash, std::string* name) {
  Catalog& c = the_catalog();
  std::lock_guard<std::mutex> g(c.mu);
  if (real() == nullptr) return EMBER_ENODRIVER;
  Image* im = find_image(c, func, kern, name);
  if (im == nullptr) return EMBER_ENOTFOUND;
  *hash = im->hash;
  return EMBER_OK;
}

static std::string options_json(const Options& o) {
  std::string s = "{";
  for (size_t i = 0; i < o.size(); ++i)
    s += strprintf("%s\"%d\":%lld", i ? "," : "", o[i].first, static_cast<long long>(o[i].second));
  return s + "}";
}

std::string catalog_json() {
  Catalog& c = the_catalog();
  std::lock_guard<std::mutex> g(c.mu);
  std::string s = "[";
  bool first = true;
  for (auto& up : c.images) {
    Image* im = up.get();
    enumerate(im);
    s += first ? "" : ",";
    first = false;
    s += strprintf("{\"hash\":\"%s\",\"kind\":\"%s\",\"wrapped\":%s,\"wrapper_version\":%d,\"size\":%zu,"
                   "\"order\":%llu,\"api\":\"%s\",\"file\":\"%s\",\"have_bytes\":%s,\"loaded\":%s,\"preload\":\"%s\",",
                   im->hash.c_str(), image_kind_name(im->kind), im->outer == ImageKind::Wrapper ? "true" : "false",
                   im->wrapper_version, im->size, static_cast<unsigned long long>(im->order),
                   json_escape(im->api).c_str(), json_escape(im->file).c_str(), im->have_bytes ? "true" : "false",
                   (!im->modules.empty() || !im->libraries.empty() || im->own_library) ? "true" : "false",
                   load_name(im->load));
    s += "\"jit_options\":" + options_json(im->jit) + ",\"library_options\":" + options_json(im->lib);
    s += ",\"linked_from\":[";
    for (size_t i = 0; i < im->linked_from.size(); ++i) s += (i ? ",\"" : "\"") + im->linked_from[i] + "\"";
    s += "]";
    s += ",\"kernels\":[";
    for (size_t i = 0; i < im->kernels.size(); ++i) s += (i ? ",\"" : "\"") + json_escape(im->kernels[i]) + "\"";
    s += "],\"attributes\":{";
    bool f2 = true;
    for (const auto& [kname, attrs] : im->attributes) {
      s += (f2 ? "\"" : ",\"") + json_escape(kname) + "\":{";
      f2 = false;
      bool f3 = true;
      for (const auto& [a, v] : attrs) {
        s += strprintf("%s\"%d\":%d", f3 ? "" : ",", a, v);
        f3 = false;
      }
      s += "}";
    }
    s += "}}";
  }
  return s + "]";
}

int catalog_image_bytes(const std::string& hash, const std::vector<uint8_t>** bytes) {
  Catalog& c = the_catalog();
  std::lock_guard<std::mutex> g(c.mu);
  auto it = c.by_hash.find(hash);
  if (it == c.by_hash.end() || !it->second->have_bytes) return EMBER_ENOTFOUND;
  *bytes = &it->second->bytes;  // images are never destroyed, and bytes never change once set
  return EMBER_OK;
}

int catalog_preload(std::vector<PreloadItem> items) {
  Catalog& c = the_catalog();
  if (real() == nullptr) return EMBER_ENODRIVER;
  // Copying and hashing are most of a hand-off (an image is up to megabytes): in parallel, and
  // outside the lock the loaders and function() need.
  const uint64_t t0 = now_ns();
  std::vector<std::vector<uint8_t>> bytes(items.size());
  std::vector<std::string> got(items.size());
  parallel_for(items.size(), std::thread::hardware_concurrency(), [&](size_t i) {
    bytes[i].assign(items[i].data, items[i].data + items[i].size);
    got[i] = hash_hex(bytes[i].data(), bytes[i].size());
  });
  std::lock_guard<std::mutex> g(c.mu);
  c.ns_hash += now_ns() - t0;
  if (c.preload_t0 == 0) c.preload_t0 = t0;
  int bad = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    PreloadItem& it = items[i];
    if (got[i] != it.hash) {
      EMBER_LOG(Warn, "Preload: image bytes hash to %s, not %s; skipped", got[i].c_str(), it.hash.c_str());
      ++bad;
      continue;
    }
    Image* im = intern(c, it.hash);
    if (im->load != Load::None || !im->libraries.empty() || im->own_library) continue;  // loading or loaded
    if (!im->have_bytes) {
      const ImageSpan span = size_image(bytes[i].data(), bytes[i].size());
      im->kind = span.kind;
      im->size = bytes[i].size();
      im->api = "preload";
      im->bytes = std::move(bytes[i]);
      im->have_bytes = true;
      im->jit = std::move(it.jit);
      im->lib = std::move(it.lib);
    }
    im->load = Load::Queued;
    c.queue.push_back(im);
  }
  // Loader threads (EMBER_LOADER_THREADS, default 4): cuLibraryLoadData of the queue, in order.
  const int threads = static_cast<int>(std::max<uint64_t>(1, env_u64("EMBER_LOADER_THREADS", 4)));
  const int want = std::min<int>(threads, static_cast<int>(c.queue.size()));
  for (; c.workers < want; ++c.workers) std::thread(worker).detach();
  return bad ? EMBER_EFORMAT : EMBER_OK;
}

int catalog_function(const std::string& hash, const std::string& name, uint64_t* func) {
  Catalog& c = the_catalog();
  const Real* r = real();
  if (r == nullptr) return EMBER_ENODRIVER;
  std::unique_lock<std::mutex> g(c.mu);
  auto it = c.by_hash.find(hash);
  if (it == c.by_hash.end()) {
    set_last_error("function: unknown image " + hash);
    return EMBER_ENOTFOUND;
  }
  Image* im = it->second;
  const uint64_t t0 = now_ns();
  c.cv.wait(g, [&] { return im->load != Load::Queued && im->load != Load::Loading; });  // only its own image
  c.ns_wait += now_ns() - t0;
  CUlibrary lib = im->own_library ? im->own_library : (im->libraries.empty() ? nullptr : im->libraries.front());
  if (lib == nullptr && im->modules.empty()) {
    if (!im->have_bytes) {
      set_last_error("function: image " + hash + " is not loaded and its bytes are not here");
      return EMBER_ENOTFOUND;
    }
    im->load = Load::Loading;
    g.unlock();
    CUlibrary fresh = nullptr;
    const CUresult rc = load_library_bytes(im, &fresh);
    g.lock();
    if (rc != CUDA_SUCCESS) {
      im->load = Load::Failed;
      c.cv.notify_all();
      set_last_error(strprintf("function: loading image %s failed: CUresult %d", hash.c_str(), static_cast<int>(rc)));
      return EMBER_EDRIVER;
    }
    im->own_library = lib = fresh;
    c.by_library[fresh] = im;
    im->load = Load::Loaded;
    c.cv.notify_all();
  }
  // The driver's part without the lock: loaders finishing meanwhile need it.
  const CUmodule mod = lib == nullptr ? im->modules.front() : nullptr;
  g.unlock();
  const uint64_t t1 = now_ns();
  CUfunction f = nullptr;
  CUresult rc;
  if (lib != nullptr) {
    CUkernel k = nullptr;
    rc = r->cuLibraryGetKernel ? r->cuLibraryGetKernel(&k, lib, name.c_str()) : kNoDriver;
    if (rc == CUDA_SUCCESS) rc = r->cuKernelGetFunction ? r->cuKernelGetFunction(&f, k) : kNoDriver;
  } else {
    rc = r->cuModuleGetFunction ? r->cuModuleGetFunction(&f, mod, name.c_str()) : kNoDriver;
  }
  if (rc == CUDA_ERROR_NOT_FOUND) {
    set_last_error("function: no kernel " + name + " in image " + hash);
    return EMBER_ENOTFOUND;
  }
  if (rc != CUDA_SUCCESS) {
    set_last_error(strprintf("function: CUresult %d for %s", static_cast<int>(rc), name.c_str()));
    return EMBER_EDRIVER;
  }
  // Lazy loading: a graph built from this function needs it loaded now.
  CUfunctionLoadingState st = CU_FUNCTION_LOADING_STATE_LOADED;
  if (r->cuFuncIsLoaded && r->cuFuncIsLoaded(&st, f) == CUDA_SUCCESS && st != CU_FUNCTION_LOADING_STATE_LOADED &&
      r->cuFuncLoad)
    r->cuFuncLoad(f);
  g.lock();
  c.ns_function += now_ns() - t1;
  *func = reinterpret_cast<uint64_t>(f);
  return EMBER_OK;
}

std::string catalog_stats_json() {
  Catalog& c = the_catalog();
  std::lock_guard<std::mutex> g(c.mu);
  // Each preloaded image: [bytes, load start after the first preload call (ms), load (ms)].
  std::vector<const Image*> loaded;
  for (const auto& up : c.images)
    if (up->load_ns) loaded.push_back(up.get());
  std::sort(loaded.begin(), loaded.end(), [](auto* a, auto* b) { return a->load_start_ns < b->load_start_ns; });
  std::string loads = "[";
  for (const Image* im : loaded)
    loads += strprintf("%s[%zu,%.3f,%.3f]", loads.size() > 1 ? "," : "", im->size,
                       (im->load_start_ns - c.preload_t0) / 1e6, im->load_ns / 1e6);
  loads += "]";
  return strprintf(  // strprintf's buffer is short: the list is appended, not formatted
             "{\"images\":%zu,\"loads\":%llu,\"unsized\":%llu,\"preloaded\":%llu,\"preload_failed\":%llu,"
             "\"preload_pending\":%zu,\"seconds\":{\"hash\":%.6f,\"preload\":%.6f,\"function_wait\":%.6f,"
             "\"function\":%.6f},\"preloads\":",
             c.images.size(), static_cast<unsigned long long>(c.loads), static_cast<unsigned long long>(c.unsized),
             static_cast<unsigned long long>(c.preloaded), static_cast<unsigned long long>(c.preload_failed),
             c.queue.size(), c.ns_hash / 1e9, c.ns_preload / 1e9, c.ns_wait / 1e9, c.ns_function / 1e9) +
         loads + "}";
}

}  // namespace ember
