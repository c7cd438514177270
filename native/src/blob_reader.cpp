// ember_read_images: LOAD's kernel-image reader. Python names the blob files of a local archive
// in need order (path, sizes, digests, codec); reader threads here read each file, check its size
// and sha256, zstd-decompress it, check the raw size and sha256, and hand it to the catalog's
// loaders (catalog_preload checks the content hash). None of it takes the GIL: in Python the same
// reads took 89 ms for 187 blobs on an H100, turn about with the first template's preparation.
// Python paces it (ember_read_allow: the first key's images first) and waits on a prefix
// (ember_read_wait). libzstd and libcrypto are opened at first use; without them the call answers
// EMBER_EUNAVAILABLE and Python reads the blobs itself.
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "catalog.h"
#include "common.h"
#include "ember.h"
#include "images.h"

using namespace ember;

namespace {

struct Codecs {
  size_t (*decompress)(void*, size_t, const void*, size_t) = nullptr;  // ZSTD_decompress
  unsigned (*is_error)(size_t) = nullptr;                              // ZSTD_isError
  const char* (*error_name)(size_t) = nullptr;                         // ZSTD_getErrorName
  unsigned char* (*sha256)(const unsigned char*, size_t, unsigned char*) = nullptr;  // SHA256
};

const Codecs* codecs() {
  static const Codecs* once = []() -> const Codecs* {
    void* z = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    void* k = nullptr;
    for (const char* name : {"libcrypto.so.3", "libcrypto.so.1.1"})
      if ((k = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    if (z == nullptr || k == nullptr) return nullptr;
    static Codecs c;
    c.decompress = reinterpret_cast<decltype(c.decompress)>(real_dlsym(z, "ZSTD_decompress"));
    c.is_error = reinterpret_cast<decltype(c.is_error)>(real_dlsym(z, "ZSTD_isError"));
    c.error_name = reinterpret_cast<decltype(c.error_name)>(real_dlsym(z, "ZSTD_getErrorName"));
    c.sha256 = reinterpret_cast<decltype(c.sha256)>(real_dlsym(k, "SHA256"));
    return c.decompress && c.is_error && c.error_name && c.sha256 ? &c : nullptr;
  }();
  return once;
}

std::string sha256_hex(const Codecs& c, const std::vector<uint8_t>& b) {
  unsigned char md[32];
  c.sha256(b.data(), b.size(), md);
  static const char* digits = "0123456789abcdef";
  std::string s(64, '0');
  for (int i = 0; i < 32; ++i) {
    s[2 * i] = digits[md[i] >> 4];
    s[2 * i + 1] = digits[md[i] & 15];
  }
  return s;
}

struct Item {
  std::string name, hash, path, sha256, raw_sha256;
  uint64_t stored = 0, raw = 0;
  int codec = 0;
  Options jit, lib;
};

struct Failure {
  int rc = EMBER_OK;
  std::string msg;
};

bool read_file(const std::string& path, uint64_t size, std::vector<uint8_t>* out, std::string* why, int* rc) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *rc = errno == ENOENT ? EMBER_ENOTFOUND : EMBER_EFORMAT;
    *why = strprintf("cannot be read: %s", strerror(errno));
    return false;
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != size) {
    *why = strprintf("is %lld bytes, the manifest says %llu", static_cast<long long>(st.st_size),
                     static_cast<unsigned long long>(size));
    close(fd);
    return false;
  }
  out->resize(size);
  size_t got = 0;
  while (got < size) {
    const ssize_t n = pread(fd, out->data() + got, size - got, static_cast<off_t>(got));
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      *why = strprintf("short read at byte %zu", got);
      close(fd);
      return false;
    }
    got += static_cast<size_t>(n);
  }
  close(fd);
  return true;
}

std::string what_of(const Item& it) { return strprintf("blob '%s' (%.12s)", it.name.c_str(), it.sha256.c_str()); }

// Reads and verifies one image into *raw; the failure names the blob.
Failure read_one(const Item& it, const Codecs& c, std::vector<uint8_t>* raw) {
  const std::string what = what_of(it);
  std::vector<uint8_t> stored;
  std::string why;
  int rc = EMBER_EFORMAT;
  if (!read_file(it.path, it.stored, &stored, &why, &rc)) return {rc, what + " " + why};
  if (sha256_hex(c, stored) != it.sha256) return {EMBER_EFORMAT, what + ": stored bytes do not match their digest"};
  if (it.codec == 1) {
    raw->resize(it.raw);
    const size_t n = c.decompress(raw->data(), raw->size(), stored.data(), stored.size());
    if (c.is_error(n)) return {EMBER_EFORMAT, what + " does not decompress: " + c.error_name(n)};
    if (n != it.raw)
      return {EMBER_EFORMAT, strprintf("%s decompresses to %zu bytes, the manifest says %llu", what.c_str(), n,
                                       static_cast<unsigned long long>(it.raw))};
  } else {
    raw->swap(stored);
    if (raw->size() != it.raw) return {EMBER_EFORMAT, what + ": its size differs from the manifest's"};
  }
  if (!it.raw_sha256.empty() && sha256_hex(c, *raw) != it.raw_sha256)
    return {EMBER_EFORMAT, what + ": uncompressed bytes do not match their digest"};
  return {};
}

// Hands one verified image to the catalog's loaders (which check its content hash).
Failure preload_one(const Item& it, const std::vector<uint8_t>& raw) {
  PreloadItem p;
  p.hash = it.hash;
  p.data = raw.data();
  p.size = raw.size();
  p.jit = it.jit;
  p.lib = it.lib;
  const int rc = catalog_preload({p});
  if (rc == EMBER_EFORMAT) return {rc, what_of(it) + ": image bytes do not hash to " + it.hash};
  if (rc == EMBER_ENODRIVER) return {rc, what_of(it) + ": no CUDA driver"};
  if (rc != EMBER_OK) return {rc, what_of(it) + ": " + last_error()};
  return {};
}

struct Reads {
  std::vector<Item> items;
  const Codecs* codecs = nullptr;
  std::mutex mu;
  std::condition_variable cv;
  size_t allowed = 0, next = 0, prefix = 0;  // may read [0, allowed); claimed [0, next); preloaded [0, prefix)
  std::vector<std::vector<uint8_t>> ready;   // read and verified, not yet preloaded
  std::vector<char> is_ready;
  bool handing = false;  // one thread at a time preloads the ready prefix, in order
  bool stop = false;
  Failure failure;  // the first damaged blob: the others stop
  std::vector<std::thread> threads;

  void work() {
    for (;;) {
      size_t i;
      {
        std::unique_lock<std::mutex> g(mu);
        cv.wait(g, [&] { return stop || failure.rc != EMBER_OK || next < allowed || next >= items.size(); });
        if (stop || failure.rc != EMBER_OK || next >= items.size()) return;
        i = next++;
      }
      std::vector<uint8_t> raw;
      Failure f = read_one(items[i], *codecs, &raw);
      std::unique_lock<std::mutex> g(mu);
      if (f.rc != EMBER_OK) {
        fail(std::move(f));
        continue;
      }
      ready[i].swap(raw);
      is_ready[i] = 1;
      if (!handing) hand(g);
    }
  }

  void fail(Failure f) {  // under mu
    if (failure.rc == EMBER_OK) failure = std::move(f);
    cv.notify_all();
  }

  // Preloads the ready prefix in the archive's order (the loaders' queue keeps it), the lock
  // dropped meanwhile; images that become ready behind it are taken in the next round.
  void hand(std::unique_lock<std::mutex>& g) {
    handing = true;
    for (;;) {
      std::vector<size_t> batch;
      for (size_t k = prefix; k < items.size() && is_ready[k]; ++k) batch.push_back(k);
      if (batch.empty() || failure.rc != EMBER_OK || stop) break;
      std::vector<std::vector<uint8_t>> bytes(batch.size());
      for (size_t b = 0; b < batch.size(); ++b) bytes[b].swap(ready[batch[b]]);
      g.unlock();
      Failure f;
      size_t handed = 0;
      for (; handed < batch.size() && f.rc == EMBER_OK; ++handed) f = preload_one(items[batch[handed]], bytes[handed]);
      g.lock();
      if (f.rc != EMBER_OK) {
        fail(std::move(f));
        break;
      }
      prefix += handed;
      cv.notify_all();
    }
    handing = false;
  }
};

}  // namespace

extern "C" {

EMBER_EXPORT int ember_read_images(const ember_blob_read* items, size_t n, int threads, void** reads) {
  if (reads == nullptr || (n > 0 && items == nullptr)) {
    set_last_error("read_images: null argument");
    return EMBER_EINVAL;
  }
  const Codecs* c = codecs();
  if (c == nullptr) {
    set_last_error("read_images: libzstd.so.1 or libcrypto (so.3 / so.1.1) is not in this system");
    return EMBER_EUNAVAILABLE;
  }
  auto* r = new Reads;
  r->codecs = c;
  r->items.resize(n);
  r->ready.resize(n);
  r->is_ready.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const ember_blob_read& s = items[i];
    Item& it = r->items[i];
    if (s.name == nullptr || s.hash == nullptr || s.path == nullptr || s.sha256 == nullptr || s.raw_size == 0 ||
        s.raw_size > kMaxImage || (s.codec != 0 && s.codec != 1) ||
        !parse_options(s.options_json, &it.jit, &it.lib)) {
      delete r;
      set_last_error(strprintf("read_images: blob %zu is described badly", i));
      return EMBER_EINVAL;
    }
    it.name = s.name;
    it.hash = s.hash;
    it.path = s.path;
    it.sha256 = s.sha256;
    it.raw_sha256 = s.raw_sha256 ? s.raw_sha256 : "";
    it.stored = s.stored_size;
    it.raw = s.raw_size;
    it.codec = s.codec;
  }
  for (int t = 0; t < std::max(1, threads); ++t) r->threads.emplace_back([r] { r->work(); });
  *reads = r;
  return EMBER_OK;
}

EMBER_EXPORT int ember_read_allow(void* reads, size_t upto) {
  auto* r = static_cast<Reads*>(reads);
  if (r == nullptr) return EMBER_EINVAL;
  std::lock_guard<std::mutex> g(r->mu);
  r->allowed = std::max(r->allowed, std::min(upto, r->items.size()));
  r->cv.notify_all();
  return EMBER_OK;
}

EMBER_EXPORT int ember_read_wait(void* reads, size_t upto, uint32_t timeout_ms, size_t* done) {
  auto* r = static_cast<Reads*>(reads);
  if (r == nullptr || done == nullptr) return EMBER_EINVAL;
  std::unique_lock<std::mutex> g(r->mu);
  r->cv.wait_for(g, std::chrono::milliseconds(timeout_ms),
                 [&] { return r->failure.rc != EMBER_OK || r->prefix >= std::min(upto, r->items.size()); });
  *done = r->prefix;
  if (r->failure.rc != EMBER_OK) {
    set_last_error(r->failure.msg);
    return r->failure.rc;
  }
  return EMBER_OK;
}

EMBER_EXPORT int ember_read_close(void* reads) {
  auto* r = static_cast<Reads*>(reads);
  if (r == nullptr) return EMBER_OK;
  {
    std::lock_guard<std::mutex> g(r->mu);
    r->stop = true;
    r->cv.notify_all();
  }
  for (auto& t : r->threads) t.join();  // at most the reads in flight finish
  delete r;
  return EMBER_OK;
}

}  // extern "C"
