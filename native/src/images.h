// Kernel images in memory: sizing by magic number without over-reading, and the content hash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ember {

enum class ImageKind : int { Unknown = 0, Wrapper = 1, Fatbin = 2, Elf = 3, Ptx = 4 };
const char* image_kind_name(ImageKind k);

constexpr uint32_t kWrapperMagic = 0x466243B1u;
constexpr uint32_t kFatbinMagic = 0xBA55ED50u;
constexpr size_t kMaxImage = size_t{4} << 30;  // refuse images larger than 4 GiB

// Copies len bytes from p into out; false (no fault) if any byte is unreadable.
bool safe_read(const void* p, void* out, size_t len);
// True when every page of [p, p+n) can be read.
bool readable_range(const void* p, size_t n);

struct ImageSpan {
  ImageKind kind = ImageKind::Unknown;  // kind of the bytes at `data` (never Wrapper)
  ImageKind outer = ImageKind::Unknown; // Wrapper when `data` came from a wrapper
  const void* data = nullptr;           // first byte of the image proper
  size_t size = 0;
  int wrapper_version = 0;              // 2: the wrapper lists further fatbins to link
  std::string error;                    // why sizing failed
};

// Sizes the image at p (limit: bytes known to be there, 0 = unknown).
ImageSpan size_image(const void* p, size_t limit);
// A version-2 wrapper's link list: the fatbins to link with its own (NULL-terminated array at
// filename_or_fatbins), each sized; false if the list or an entry cannot be read or sized.
bool wrapper_link_list(const void* wrapper, std::vector<ImageSpan>* out);
// Reads a sized image into a private buffer; false if it is not fully readable.
bool copy_image(const ImageSpan& span, std::vector<uint8_t>* out);

uint64_t hash64(const void* data, size_t len, uint64_t seed = 0);
std::string hash_hex(const void* data, size_t len);

}  // namespace ember
