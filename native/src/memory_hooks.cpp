// Hooks of the memory API: pass-through unless the region serves the call (allocator.cpp).
#include "allocator.h"

#define RA __builtin_return_address(0)

using namespace ember;

namespace {
// The real pointer for hook `sym`, or return the driver's "not initialized" code.
#define REAL_OR_FAIL(sym)                          \
  const Real* r = real();                          \
  if (r == nullptr || r->sym == nullptr) return kNoDriver

bool active() { return mode() != Mode::Off; }

// Memory asked for by NCCL (libnccl's own cudaMalloc/cuMem calls, any of its threads) or by
// ember's NCCL stub is per-rank communication state: a real communicator at LOAD allocates what
// the stub at SAVE never did. It stays out of the fixed-base layout, so the engine's addresses
// match between a one-GPU SAVE and every rank's LOAD (docs/multi-gpu.md).
bool communicator_memory(const void* ra) {
  const std::string lib = caller_library(ra);
  return lib.rfind("libnccl", 0) == 0 || lib.rfind("libember_nccl", 0) == 0;
}

// The region serves this call: ember is active and the caller is not a communicator.
bool serves(const void* ra) { return active() && !communicator_memory(ra); }
}  // namespace

extern "C" {

EMBER_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytesize) {
  REAL_OR_FAIL(cuMemAlloc_v2);
  CUresult rc;
  if (serves(RA) && region_alloc(Kind::Alloc, dptr, bytesize, 0, RA, &rc)) return rc;
  return r->cuMemAlloc_v2(dptr, bytesize);
}

EMBER_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr* dptr, size_t* pitch, size_t width, size_t height,
                                         unsigned int elem) {
  REAL_OR_FAIL(cuMemAllocPitch_v2);
  if (serves(RA) && pitch != nullptr && width > 0 && height > 0 && (elem == 4 || elem == 8 || elem == 16)) {
    const size_t p = (width + 511) / 512 * 512;
    CUresult rc;
    if (region_alloc(Kind::Pitch, dptr, p * height, 512, RA, &rc)) {
      if (rc == CUDA_SUCCESS) *pitch = p;
      return rc;
    }
  }
  return r->cuMemAllocPitch_v2(dptr, pitch, width, height, elem);
}

EMBER_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
  REAL_OR_FAIL(cuMemFree_v2);
  CUresult rc;
  if (active() && region_free(Kind::Free, dptr, nullptr, RA, &rc)) return rc;
  return r->cuMemFree_v2(dptr);
}

#define ASYNC_ALLOC(sym)                                                               \
  EMBER_EXPORT CUresult sym(CUdeviceptr* dptr, size_t bytesize, CUstream stream) {     \
    REAL_OR_FAIL(sym);                                                                 \
    CUresult rc;                                                                       \
    if (serves(RA) && region_alloc(Kind::Async, dptr, bytesize, 0, RA, &rc)) return rc;  \
    return r->sym(dptr, bytesize, stream);                                             \
  }
ASYNC_ALLOC(cuMemAllocAsync)
ASYNC_ALLOC(cuMemAllocAsync_ptsz)

#define POOL_ALLOC(sym)                                                                          \
  EMBER_EXPORT CUresult sym(CUdeviceptr* dptr, size_t bytesize, CUmemoryPool pool, CUstream stream) { \
    REAL_OR_FAIL(sym);                                                                           \
    CUresult rc;                                                                                 \
    if (serves(RA) && region_alloc(Kind::Pool, dptr, bytesize, 0, RA, &rc)) return rc;             \
    return r->sym(dptr, bytesize, pool, stream);                                                 \
  }
POOL_ALLOC(cuMemAllocFromPoolAsync)
POOL_ALLOC(cuMemAllocFromPoolAsync_ptsz)

#define ASYNC_FREE(sym)                                                                    \
  EMBER_EXPORT CUresult sym(CUdeviceptr dptr, CUstream stream) {                           \
    REAL_OR_FAIL(sym);                                                                     \
    CUresult rc;                                                                           \
    if (active() && region_free(Kind::FreeAsync, dptr, stream, RA, &rc)) return rc;        \
    return r->sym(dptr, stream);                                                           \
  }
ASYNC_FREE(cuMemFreeAsync)
ASYNC_FREE(cuMemFreeAsync_ptsz)

EMBER_EXPORT CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                          unsigned long long flags) {
  REAL_OR_FAIL(cuMemAddressReserve);
  CUresult rc;
  if (serves(RA) && region_reserve(ptr, size, alignment, addr, flags, RA, &rc)) return rc;
  return r->cuMemAddressReserve(ptr, size, alignment, addr, flags);
}

EMBER_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  REAL_OR_FAIL(cuMemAddressFree);
  CUresult rc;
  if (active() && region_unreserve(ptr, size, RA, &rc)) return rc;
  return r->cuMemAddressFree(ptr, size);
}

EMBER_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr* pbase, size_t* psize, CUdeviceptr dptr) {
  REAL_OR_FAIL(cuMemGetAddressRange_v2);
  CUresult rc;
  if (active() && region_address_range(pbase, psize, dptr, &rc)) return rc;
  return r->cuMemGetAddressRange_v2(pbase, psize, dptr);
}

EMBER_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                               unsigned long long flags) {
  REAL_OR_FAIL(cuMemMap);
  const CUresult rc = r->cuMemMap(ptr, size, offset, handle, flags);
  if (rc == CUDA_SUCCESS && active()) region_note_map(ptr, size, offset, RA);
  return rc;
}

EMBER_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  REAL_OR_FAIL(cuMemUnmap);
  const CUresult rc = r->cuMemUnmap(ptr, size);
  if (rc == CUDA_SUCCESS && active()) region_note_unmap(ptr, size, RA);
  return rc;
}

}  // extern "C"
