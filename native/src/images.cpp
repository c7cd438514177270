// Sizing in-memory kernel images by magic number (wrapper, fatbin chains, ELF cubins, PTX) and
// hashing them. Every read goes through safe_read: a hostile or truncated image ends in a clear
// error, never a fault, and nothing beyond the computed size is read.
#include "images.h"

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common.h"

namespace ember {

const char* image_kind_name(ImageKind k) {
  switch (k) {
    case ImageKind::Wrapper: return "wrapper";
    case ImageKind::Fatbin: return "fatbin";
    case ImageKind::Elf: return "elf";
    case ImageKind::Ptx: return "ptx";
    default: return "unknown";
  }
}

// process_vm_readv on ourselves reports EFAULT for unreadable pages instead of faulting.
bool safe_read(const void* p, void* out, size_t len) {
  if (len == 0) return true;
  if (p == nullptr) return false;
  size_t done = 0;
  while (done < len) {
    iovec local{static_cast<char*>(out) + done, len - done};
    iovec remote{const_cast<char*>(static_cast<const char*>(p)) + done, len - done};
    const ssize_t n = process_vm_readv(getpid(), &local, 1, &remote, 1, 0);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

// Every page of [p, p+n) readable? One byte per page, up to 1024 pages per system call.
bool readable_range(const void* p, size_t n) {
  if (n == 0) return true;
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  const uintptr_t last = start + n - 1;
  if (last < start) return false;
  constexpr size_t kBatch = 1024;
  iovec local[kBatch], remote[kBatch];
  unsigned char sink[kBatch];
  size_t k = 0;
  auto flush = [&]() {
    const ssize_t got = k ? process_vm_readv(getpid(), local, k, remote, k, 0) : 0;
    const bool ok = got == static_cast<ssize_t>(k);
    k = 0;
    return ok;
  };
  for (uintptr_t a = start;;) {
    local[k] = {&sink[k], 1};
    remote[k] = {reinterpret_cast<void*>(a), 1};
    if (++k == kBatch && !flush()) return false;
    const uintptr_t next = (a | 4095u) + 1;
    if (next == 0 || next > last) break;
    a = next;
  }
  return flush();
}

namespace {

bool within(size_t limit, uint64_t end) { return limit == 0 || end <= limit; }

// One fatbin or (chain = true) a chain of them, starting at p.
void size_fatbin(const uint8_t* p, size_t limit, ImageSpan* out, bool chain = true) {
  uint64_t total = 0;
  for (int n = 0; chain || n == 0; ++n) {
    struct {
      uint32_t magic;
      uint16_t version;
      uint16_t header_size;
      uint64_t size;
    } h;
    if (!within(limit, total + sizeof h) || !safe_read(p + total, &h, sizeof h)) {
      if (n == 0) out->error = "truncated fatbin header";
      break;  // the chain ends where no further header can be read
    }
    if (h.magic != kFatbinMagic) {
      if (n == 0) out->error = "not a fatbin";
      break;
    }
    if (h.header_size < sizeof h || h.size > kMaxImage || total + h.header_size + h.size > kMaxImage) {
      out->error = "fatbin header claims an impossible size";
      return;
    }
    const uint64_t end = total + h.header_size + h.size;
    if (!within(limit, end)) {
      out->error = "fatbin extends past the end of the buffer";
      return;
    }
    // The whole body must be readable (every page of it).
    if (!readable_range(p + total, end - total)) {
      out->error = "fatbin body is not readable";
      return;
    }
    total = end;
  }
  if (total == 0) return;
  out->error.clear();
  out->kind = ImageKind::Fatbin;
  out->data = p;
  out->size = total;
}

void size_elf(const uint8_t* p, size_t limit, ImageSpan* out) {
  struct Ehdr {
    unsigned char ident[16];
    uint16_t type, machine;
    uint32_t version;
    uint64_t entry, phoff, shoff;
    uint32_t flags;
    uint16_t ehsize, phentsize, phnum, shentsize, shnum, shstrndx;
  } e;
  static_assert(sizeof(Ehdr) == 64, "ELF64 header");
  if (!within(limit, sizeof e) || !safe_read(p, &e, sizeof e)) {
    out->error = "truncated ELF header";
    return;
  }
  if (e.ident[4] != 2 || e.ident[5] != 1) {
    out->error = "not a 64-bit little-endian ELF";
    return;
  }
  uint64_t end = sizeof e;
  if (e.shnum > 0) {
    if (e.shentsize < 64 || e.shoff > kMaxImage) {
      out->error = "bad ELF section header table";
      return;
    }
    end = std::max<uint64_t>(end, e.shoff + uint64_t{e.shentsize} * e.shnum);
  }
  if (e.phnum > 0) {
    if (e.phentsize < 56 || e.phoff > kMaxImage) {
      out->error = "bad ELF program header table";
      return;
    }
    end = std::max<uint64_t>(end, e.phoff + uint64_t{e.phentsize} * e.phnum);
  }
  // Sections may lie past the tables: take the furthest section end (SHT_NOBITS occupy nothing).
  for (uint32_t i = 0; i < e.shnum && end <= kMaxImage; ++i) {
    struct {
      uint32_t name, type;
      uint64_t flags, addr, offset, size;
    } sh;
    const uint64_t at = e.shoff + uint64_t{e.shentsize} * i;
    if (!within(limit, at + sizeof sh) || !safe_read(p + at, &sh, sizeof sh)) {
      out->error = "truncated ELF section headers";
      return;
    }
    if (sh.type != 8 /* SHT_NOBITS */ && sh.size > 0) {
      if (sh.offset > kMaxImage || sh.size > kMaxImage) {
        out->error = "ELF section claims an impossible size";
        return;
      }
      end = std::max<uint64_t>(end, sh.offset + sh.size);
    }
  }
  if (end > kMaxImage || !within(limit, end)) {
    out->error = "ELF extends past the end of the buffer";
    return;
  }
  if (!readable_range(p, end)) {
    out->error = "ELF body is not readable";
    return;
  }
  out->kind = ImageKind::Elf;
  out->data = p;
  out->size = end;
}

void size_ptx(const uint8_t* p, size_t limit, ImageSpan* out) {
  // strlen + 1, page-safe: read in chunks that never cross into an unreadable page.
  uint8_t buf[4096];
  uint64_t n = 0;
  for (;;) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(p + n);
    size_t chunk = 4096 - (addr & 4095);  // up to the end of this page
    if (limit) chunk = std::min<uint64_t>(chunk, limit - n);
    if (chunk == 0 || !safe_read(p + n, buf, chunk)) {
      out->error = "PTX text is not NUL-terminated within readable memory";
      return;
    }
    const void* z = memchr(buf, 0, chunk);
    if (z != nullptr) {
      n += static_cast<size_t>(static_cast<const uint8_t*>(z) - buf) + 1;
      break;
    }
    n += chunk;
    if (n > kMaxImage) {
      out->error = "PTX text too large";
      return;
    }
  }
  out->kind = ImageKind::Ptx;
  out->data = p;
  out->size = n;
}

bool looks_like_text(const uint8_t* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (b[i] == 0) return i > 0;
    if (b[i] < 0x09 || (b[i] > 0x0d && b[i] < 0x20) || b[i] >= 0x7f) return false;
  }
  return true;
}

}  // namespace

ImageSpan size_image(const void* image, size_t limit) {
  ImageSpan out;
  const auto* p = static_cast<const uint8_t*>(image);
  uint8_t head[16] = {};
  size_t have = 0;
  // Read as much of the first 16 bytes as exists (the image may be shorter than 16 bytes).
  for (size_t n = limit ? std::min<size_t>(16, limit) : 16; n > 0; --n)
    if (safe_read(p, head, n)) {
      have = n;
      break;
    }
  if (have == 0) {
    out.error = image == nullptr ? "null image" : "image is not readable";
    return out;
  }
  uint32_t magic = 0;
  if (have >= 4) memcpy(&magic, head, 4);
  if (magic == kWrapperMagic) {
    struct {
      int32_t magic, version;
      uint64_t data, filename_or_fatbins;
    } w;
    if (!within(limit, sizeof w) || !safe_read(p, &w, sizeof w)) {
      out.error = "truncated fatbin wrapper";
      return out;
    }
    if (w.version != 1 && w.version != 2) {
      out.error = "unknown fatbin wrapper version";
      return out;
    }
    // The wrapper points elsewhere: the fatbin's own extent is unknown, so no limit applies.
    // Only its first fatbin: a compiler-generated wrapper points into a section where the next
    // translation unit's fatbin follows, which is not part of this image.
    size_fatbin(reinterpret_cast<const uint8_t*>(w.data), 0, &out, false);
    out.outer = ImageKind::Wrapper;
    out.wrapper_version = w.version;
    if (out.kind == ImageKind::Unknown && out.error.empty()) out.error = "wrapper data is not a fatbin";
    return out;
  }
  if (magic == kFatbinMagic) {
    size_fatbin(p, limit, &out);
    return out;
  }
  if (have >= 4 && head[0] == 0x7f && head[1] == 'E' && head[2] == 'L' && head[3] == 'F') {
    size_elf(p, limit, &out);
    return out;
  }
  if (looks_like_text(head, have)) {
    size_ptx(p, limit, &out);
    return out;
  }
  out.error = "unknown image format";
  return out;
}

bool wrapper_link_list(const void* wrapper, std::vector<ImageSpan>* out) {
  struct {
    int32_t magic, version;
    uint64_t data, list;
  } w;
  if (!safe_read(wrapper, &w, sizeof w) || w.magic != static_cast<int32_t>(kWrapperMagic) || w.version != 2)
    return false;
  out->clear();
  for (size_t i = 0; w.list != 0; ++i) {
    if (i >= 1024) return false;  // a list that long is not a link list
    uint64_t entry = 0;
    if (!safe_read(reinterpret_cast<const void*>(w.list + 8 * i), &entry, sizeof entry)) return false;
    if (entry == 0) break;
    ImageSpan span = size_image(reinterpret_cast<const void*>(entry), 0);
    if (span.kind == ImageKind::Unknown) return false;
    out->push_back(span);
  }
  return true;
}

bool copy_image(const ImageSpan& span, std::vector<uint8_t>* out) {
  if (span.kind == ImageKind::Unknown || span.size == 0 || span.size > kMaxImage) return false;
  out->resize(span.size);
  return safe_read(span.data, out->data(), span.size);
}

// xxHash64 (Yann Collet's algorithm, written from its specification).
namespace {
constexpr uint64_t P1 = 11400714785074694791ull, P2 = 14029467366897019727ull, P3 = 1609587929392839161ull,
                   P4 = 9650029242287828579ull, P5 = 2870177450012600261ull;
inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t rd64(const uint8_t* p) { uint64_t v; memcpy(&v, p, 8); return v; }
inline uint32_t rd32(const uint8_t* p) { uint32_t v; memcpy(&v, p, 4); return v; }
inline uint64_t round1(uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; }
inline uint64_t merge(uint64_t acc, uint64_t v) { return (acc ^ round1(0, v)) * P1 + P4; }
}  // namespace

uint64_t hash64(const void* data, size_t len, uint64_t seed) {
  const auto* p = static_cast<const uint8_t*>(data);
  const uint8_t* const end = p + len;
  uint64_t h;
  if (len >= 32) {
    uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
    const uint8_t* const limit = end - 32;
    do {
      v1 = round1(v1, rd64(p)); v2 = round1(v2, rd64(p + 8));
      v3 = round1(v3, rd64(p + 16)); v4 = round1(v4, rd64(p + 24));
      p += 32;
    } while (p <= limit);
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge(h, v1); h = merge(h, v2); h = merge(h, v3); h = merge(h, v4);
  } else {
    h = seed + P5;
  }
  h += static_cast<uint64_t>(len);
  while (p + 8 <= end) { h ^= round1(0, rd64(p)); h = rotl(h, 27) * P1 + P4; p += 8; }
  if (p + 4 <= end) { h ^= static_cast<uint64_t>(rd32(p)) * P1; h = rotl(h, 23) * P2 + P3; p += 4; }
  while (p < end) { h ^= (*p) * P5; h = rotl(h, 11) * P1; ++p; }
  h ^= h >> 33; h *= P2; h ^= h >> 29; h *= P3; h ^= h >> 32;
  return h;
}

std::string hash_hex(const void* data, size_t len) {
  // 128 bits from two seeds plus the length: collisions between different kernels are not an option.
  return strprintf("%016llx%016llx", static_cast<unsigned long long>(hash64(data, len, 0)),
                   static_cast<unsigned long long>(hash64(data, len, 0x9E3779B97F4A7C15ull ^ len)));
}

}  // namespace ember
