/* A tiny stand-in for libcuda.so.1 used by ember's CPU tests. It records which entry point (the
 * exact ABI variant) was called, and simulates the VMM API with mmap: a reservation is a
 * PROT_NONE mapping (the address hint is only a hint, as on a real driver), cuMemMap keeps the
 * range inaccessible until cuMemSetAccess makes it read-write. Modules and libraries "contain"
 * the kernels named by `.entry NAME` lines of PTX text, or kernel_a/kernel_b for binaries.
 * Built with -Wl,-Bsymbolic so its own references never reach the interposer (as libcuda's). */
#define _GNU_SOURCE
#include <cuda.h>
#undef cuGetProcAddress
#undef cuMemAlloc
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ---- call log ---- */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char calls[65536];
static size_t calls_len;
static void note(const char* name) {
  pthread_mutex_lock(&mu);
  size_t n = strlen(name);
  if (calls_len + n + 2 < sizeof calls) {
    memcpy(calls + calls_len, name, n);
    calls_len += n;
    calls[calls_len++] = '\n';
    calls[calls_len] = 0;
  }
  pthread_mutex_unlock(&mu);
}
EXPORT const char* standin_calls(void) { return calls; }
EXPORT void standin_reset(void) {
  pthread_mutex_lock(&mu);
  calls_len = 0;
  calls[0] = 0;
  pthread_mutex_unlock(&mu);
}
static int capturing;
EXPORT void standin_set_capturing(int on) { capturing = on; }
static uint64_t phys_limit = 0, phys_used = 0;
EXPORT void standin_set_phys_limit(uint64_t bytes) { phys_limit = bytes; }

#define GRAN (2ull << 20)

/* ---- context ---- */
static int inited;
EXPORT CUresult cuInit(unsigned flags) { note("cuInit"); inited = 1; return CUDA_SUCCESS; }
EXPORT CUresult cuGetErrorString(CUresult e, const char** s) { *s = "stand-in error"; return CUDA_SUCCESS; }
EXPORT CUresult cuCtxGetCurrent(CUcontext* c) { *c = inited ? (CUcontext)0x1 : NULL; return CUDA_SUCCESS; }
EXPORT CUresult cuCtxSetCurrent(CUcontext c) { return CUDA_SUCCESS; }
EXPORT CUresult cuCtxGetDevice(CUdevice* d) {
  if (!inited || getenv("STANDIN_NO_CTX")) return CUDA_ERROR_INVALID_CONTEXT;
  *d = 0;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceTotalMem_v2(size_t* b, CUdevice d) { *b = 1ull << 30; return CUDA_SUCCESS; }
EXPORT CUresult cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp* p,
                                              CUmemAllocationGranularity_flags f) {
  *g = GRAN;
  return CUDA_SUCCESS;
}

/* ---- VMM with mmap ---- */
struct range { uint64_t a, n; int used; };
static struct range resv[256], maps[4096];
static struct range* find_in(struct range* t, int cap, uint64_t p) {
  for (int i = 0; i < cap; i++)
    if (t[i].used && p >= t[i].a && p < t[i].a + t[i].n) return &t[i];
  return NULL;
}
static struct range* slot(struct range* t, int cap) {
  for (int i = 0; i < cap; i++)
    if (!t[i].used) return &t[i];
  return NULL;
}

EXPORT CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t align, CUdeviceptr addr,
                                    unsigned long long flags) {
  note("cuMemAddressReserve");
  if (size == 0 || size % GRAN || addr % GRAN) return CUDA_ERROR_INVALID_VALUE;
  void* p = MAP_FAILED;
  if (addr) p = mmap((void*)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
  if (p == MAP_FAILED) p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  struct range* r = slot(resv, 256);
  r->a = (uint64_t)p; r->n = size; r->used = 1;
  *ptr = (CUdeviceptr)p;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  note("cuMemAddressFree");
  struct range* r = find_in(resv, 256, ptr);
  if (!r || r->a != ptr || r->n != size) return CUDA_ERROR_INVALID_VALUE;
  munmap((void*)ptr, size);
  r->used = 0;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle* h, size_t size, const CUmemAllocationProp* p,
                            unsigned long long f) {
  note("cuMemCreate");
  if (size % GRAN) return CUDA_ERROR_INVALID_VALUE;
  if (phys_limit && phys_used + size > phys_limit) return CUDA_ERROR_OUT_OF_MEMORY;
  phys_used += size;
  *h = (CUmemGenericAllocationHandle)size;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) { note("cuMemRelease"); return CUDA_SUCCESS; }
EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t off, CUmemGenericAllocationHandle h,
                         unsigned long long f) {
  note("cuMemMap");
  struct range* r = find_in(resv, 256, ptr);
  if (!r || ptr + size > r->a + r->n || size > (size_t)h) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < 4096; i++)
    if (maps[i].used && ptr < maps[i].a + maps[i].n && maps[i].a < ptr + size) return CUDA_ERROR_INVALID_VALUE;
  struct range* m = slot(maps, 4096);
  m->a = ptr; m->n = size; m->used = 1;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* d, size_t count) {
  note("cuMemSetAccess");
  for (uint64_t p = ptr; p < ptr + size;) {
    struct range* m = find_in(maps, 4096, p);
    if (!m) return CUDA_ERROR_INVALID_VALUE;
    p = m->a + m->n;
  }
  return mprotect((void*)ptr, size, PROT_READ | PROT_WRITE) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  note("cuMemUnmap");
  struct range* m = find_in(maps, 4096, ptr);
  if (!m || m->a != ptr || m->n != size) return CUDA_ERROR_INVALID_VALUE;
  mprotect((void*)ptr, size, PROT_NONE);
  madvise((void*)ptr, size, MADV_DONTNEED);
  m->used = 0;
  return CUDA_SUCCESS;
}

/* ---- classic allocations (native: anywhere, like a driver) ---- */
static struct range allocs[4096];
static CUresult native_alloc(CUdeviceptr* p, size_t n) {
  if (!inited) return CUDA_ERROR_NOT_INITIALIZED;
  void* m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  struct range* r = slot(allocs, 4096);
  r->a = (uint64_t)m; r->n = n; r->used = 1;
  *p = (CUdeviceptr)m;
  return CUDA_SUCCESS;
}
static CUresult native_free(CUdeviceptr p) {
  struct range* r = find_in(allocs, 4096, p);
  if (!r || r->a != p) return CUDA_ERROR_INVALID_VALUE;
  munmap((void*)p, r->n);
  r->used = 0;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAlloc(unsigned int* p, unsigned int n) { note("cuMemAlloc"); return CUDA_ERROR_NOT_SUPPORTED; }
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) { note("cuMemAlloc_v2"); return native_alloc(p, n); }
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr* p, size_t* pitch, size_t w, size_t h, unsigned e) {
  note("cuMemAllocPitch_v2");
  *pitch = (w + 511) / 512 * 512;
  return native_alloc(p, *pitch * h);
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { note("cuMemFree_v2"); return native_free(p); }
#define ASYNC(name)                                                                   \
  EXPORT CUresult name(CUdeviceptr* p, size_t n, CUstream s) { note(#name); return native_alloc(p, n); }
ASYNC(cuMemAllocAsync)
ASYNC(cuMemAllocAsync_ptsz)
#define POOL(name)                                                                                \
  EXPORT CUresult name(CUdeviceptr* p, size_t n, CUmemoryPool pool, CUstream s) { note(#name); return native_alloc(p, n); }
POOL(cuMemAllocFromPoolAsync)
POOL(cuMemAllocFromPoolAsync_ptsz)
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { note("cuMemFreeAsync"); return native_free(p); }
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { note("cuMemFreeAsync_ptsz"); return native_free(p); }
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr* b, size_t* n, CUdeviceptr p) {
  note("cuMemGetAddressRange_v2");
  struct range* r = find_in(allocs, 4096, p);
  if (!r) return CUDA_ERROR_NOT_FOUND;
  if (b) *b = r->a;
  if (n) *n = r->n;
  return CUDA_SUCCESS;
}
/* Stream capture: a thread's capture collects the memsets issued meanwhile as memset nodes. */
struct sgraph;
static __thread struct sgraph* capture_graph;
static CUresult capture_memset(CUdeviceptr dst);
/* A memset writes for real (the NCCL stub's placeholder word) and is logged with its operands. */
EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int value, size_t n, CUstream s) {
  if (capture_graph) return capture_memset(dst);
  char line[96];
  snprintf(line, sizeof line, "cuMemsetD32Async:%llx:%u:%zu", (unsigned long long)dst, value, n);
  note(line);
  for (size_t i = 0; i < n; i++) ((unsigned int*)dst)[i] = value;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamSynchronize(CUstream s) { note("cuStreamSynchronize"); return CUDA_SUCCESS; }
EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s) { note("cuStreamSynchronize_ptsz"); return CUDA_SUCCESS; }
EXPORT CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus* st) {
  *st = capturing ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned smem, CUstream s, void** params, void** extra) {
  note("cuLaunchKernel");
  return CUDA_SUCCESS;
}
EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                    unsigned bz, unsigned smem, CUstream s, void** params, void** extra) {
  note("cuLaunchKernel_ptsz");
  return CUDA_SUCCESS;
}

/* ---- modules, libraries, functions, kernels ---- */
struct mod;
struct fn { struct mod* mod; char name[128]; int loaded; int attr[64]; };
struct mod { struct fn fns[16]; int n; struct mod* lib_of; int is_lib; };
static void parse_kernels(struct mod* m, const char* image) {
  const char* p = image;
  m->n = 0;
  if (image && image[0] != 0x7f && ((unsigned char)image[0] < 0x80) && strstr(image, ".entry ")) {
    while ((p = strstr(p, ".entry ")) && m->n < 16) {
      p += 7;
      int k = 0;
      while (p[k] && p[k] != ' ' && p[k] != '(' && p[k] != '\n' && k < 127) k++;
      memcpy(m->fns[m->n].name, p, k);
      m->fns[m->n].name[k] = 0;
      m->fns[m->n].mod = m;
      m->n++;
    }
  } else {
    strcpy(m->fns[0].name, "kernel_a");
    strcpy(m->fns[1].name, "kernel_b");
    m->fns[0].mod = m->fns[1].mod = m;
    m->n = 2;
  }
}
static struct mod* all_mods[1024];
static int n_mods;
/* libember loads images on several threads at once: the registry is locked (an unlocked
 * `all_mods[n_mods++] = m` lost modules, whose functions then read as invalid handles). */
static pthread_mutex_t mods_lock = PTHREAD_MUTEX_INITIALIZER;
/* Handles are checked as a driver does: an unknown one is CUDA_ERROR_INVALID_HANDLE. */
static int valid_fn(const void* f) {
  int found = 0;
  pthread_mutex_lock(&mods_lock);
  for (int i = 0; i < n_mods && !found; i++)
    found = (const char*)f >= (const char*)all_mods[i]->fns && (const char*)f < (const char*)(all_mods[i]->fns + 16);
  pthread_mutex_unlock(&mods_lock);
  return found;
}
static struct mod* new_mod(const void* image, int is_lib) {
  struct mod* m = calloc(1, sizeof *m);
  pthread_mutex_lock(&mods_lock);
  if (n_mods < 1024) all_mods[n_mods++] = m;
  pthread_mutex_unlock(&mods_lock);
  parse_kernels(m, image);
  m->is_lib = is_lib;
  return m;
}
EXPORT CUresult cuModuleLoadData(CUmodule* m, const void* image) {
  note("cuModuleLoadData");
  if (!image) return CUDA_ERROR_INVALID_VALUE;
  *m = (CUmodule)new_mod(image, 0);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleLoadDataEx(CUmodule* m, const void* image, unsigned n, CUjit_option* o, void** v) {
  note("cuModuleLoadDataEx");
  *m = (CUmodule)new_mod(image, 0);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleLoadFatBinary(CUmodule* m, const void* image) {
  note("cuModuleLoadFatBinary");
  *m = (CUmodule)new_mod(image, 0);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleLoad(CUmodule* m, const char* fname) {
  note("cuModuleLoad");
  *m = (CUmodule)new_mod(NULL, 0);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuLibraryLoadData(CUlibrary* l, const void* code, CUjit_option* jo, void** jv, unsigned nj,
                                  CUlibraryOption* lo, void** lv, unsigned nl) {
  note("cuLibraryLoadData");
  if (!code) return CUDA_ERROR_INVALID_VALUE;
  /* A fatbin wrapper: the kernels come from its data. */
  if (*(const uint32_t*)code == 0x466243B1u) code = (const void*)((const uint64_t*)code)[1];
  /* PTX naming a SLOW kernel takes 1.5 s to load (tests of loading off the critical path). */
  if (((const char*)code)[0] == '.' && strstr((const char*)code, "SLOW")) usleep(1500000);
  *l = (CUlibrary)new_mod(code, 1);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuLibraryLoadFromFile(CUlibrary* l, const char* f, CUjit_option* jo, void** jv, unsigned nj,
                                      CUlibraryOption* lo, void** lv, unsigned nl) {
  note("cuLibraryLoadFromFile");
  *l = (CUlibrary)new_mod(NULL, 1);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleUnload(CUmodule m) { note("cuModuleUnload"); return CUDA_SUCCESS; }
EXPORT CUresult cuLibraryUnload(CUlibrary l) { note("cuLibraryUnload"); return CUDA_SUCCESS; }
EXPORT CUresult cuModuleGetFunctionCount(unsigned* n, CUmodule m) { *n = ((struct mod*)m)->n; return CUDA_SUCCESS; }
EXPORT CUresult cuModuleEnumerateFunctions(CUfunction* f, unsigned n, CUmodule m) {
  struct mod* md = (struct mod*)m;
  for (unsigned i = 0; i < n && i < (unsigned)md->n; i++) f[i] = (CUfunction)&md->fns[i];
  return CUDA_SUCCESS;
}
EXPORT CUresult cuLibraryGetKernelCount(unsigned* n, CUlibrary l) { *n = ((struct mod*)l)->n; return CUDA_SUCCESS; }
EXPORT CUresult cuLibraryEnumerateKernels(CUkernel* k, unsigned n, CUlibrary l) {
  return cuModuleEnumerateFunctions((CUfunction*)k, n, (CUmodule)l);
}
EXPORT CUresult cuFuncGetName(const char** name, CUfunction f) {
  if (!valid_fn(f)) return CUDA_ERROR_INVALID_HANDLE; *name = ((struct fn*)f)->name; return CUDA_SUCCESS; }
EXPORT CUresult cuKernelGetName(const char** name, CUkernel k) {
  if (!valid_fn(k)) return CUDA_ERROR_INVALID_HANDLE; *name = ((struct fn*)k)->name; return CUDA_SUCCESS; }
/* A library's CUkernel and its CUfunction in "the" context are the same object here; its
 * module is the library object itself. */
EXPORT CUresult cuFuncGetModule(CUmodule* m, CUfunction f) {
  if (!valid_fn(f)) return CUDA_ERROR_INVALID_HANDLE; *m = (CUmodule)((struct fn*)f)->mod; return CUDA_SUCCESS; }
EXPORT CUresult cuKernelGetLibrary(CUlibrary* l, CUkernel k) {
  if (!valid_fn(k)) return CUDA_ERROR_INVALID_HANDLE;
  struct mod* m = ((struct fn*)k)->mod;
  if (!m->is_lib) return CUDA_ERROR_INVALID_HANDLE;
  *l = (CUlibrary)m;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuLibraryGetModule(CUmodule* m, CUlibrary l) { *m = (CUmodule)l; return CUDA_SUCCESS; }
static CUresult get_fn(struct mod* m, const char* name, struct fn** out) {
  for (int i = 0; i < m->n; i++)
    if (!strcmp(m->fns[i].name, name)) { *out = &m->fns[i]; return CUDA_SUCCESS; }
  return CUDA_ERROR_NOT_FOUND;
}
EXPORT CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
  note("cuModuleGetFunction");
  return get_fn((struct mod*)m, name, (struct fn**)f);
}
EXPORT CUresult cuLibraryGetKernel(CUkernel* k, CUlibrary l, const char* name) {
  note("cuLibraryGetKernel");
  return get_fn((struct mod*)l, name, (struct fn**)k);
}
EXPORT CUresult cuKernelGetFunction(CUfunction* f, CUkernel k) { *f = (CUfunction)k; return CUDA_SUCCESS; }
EXPORT CUresult cuFuncIsLoaded(CUfunctionLoadingState* s, CUfunction f) {
  *s = ((struct fn*)f)->loaded ? CU_FUNCTION_LOADING_STATE_LOADED : CU_FUNCTION_LOADING_STATE_UNLOADED;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuFuncLoad(CUfunction f) { note("cuFuncLoad"); ((struct fn*)f)->loaded = 1; return CUDA_SUCCESS; }
EXPORT CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) {
  note("cuFuncSetAttribute");
  ((struct fn*)f)->attr[a & 63] = v;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuKernelSetAttribute(CUfunction_attribute a, int v, CUkernel k, CUdevice d) {
  note("cuKernelSetAttribute");
  ((struct fn*)k)->attr[a & 63] = v;
  return CUDA_SUCCESS;
}

/* ---- linking: the "cubin" is PTX text naming one kernel per input, so a library loaded from it
 * has kernels linked_0, linked_1, ... ---- */
struct link { char text[4096]; int n; };
#undef cuLinkCreate
#undef cuLinkAddData
EXPORT CUresult cuLinkCreate_v2(unsigned n, CUjit_option* o, void** v, CUlinkState* st) {
  note("cuLinkCreate_v2");
  struct link* l = calloc(1, sizeof *l);
  strcpy(l->text, ".version 8.0\n");
  *st = (CUlinkState)l;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuLinkAddData_v2(CUlinkState st, CUjitInputType type, void* data, size_t size, const char* name,
                                 unsigned n, CUjit_option* o, void** v) {
  note("cuLinkAddData_v2");
  struct link* l = (struct link*)st;
  if (!data || !size) return CUDA_ERROR_INVALID_VALUE;
  char buf[64];
  snprintf(buf, sizeof buf, ".entry linked_%d(\n)\n", l->n++);
  strncat(l->text, buf, sizeof l->text - strlen(l->text) - 1);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuLinkComplete(CUlinkState st, void** out, size_t* size) {
  note("cuLinkComplete");
  struct link* l = (struct link*)st;
  *out = l->text;
  *size = strlen(l->text) + 1;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuLinkDestroy(CUlinkState st) {
  note("cuLinkDestroy");
  memset(st, 0, sizeof(struct link)); /* the output dies with the state, as in the driver */
  free(st);
  return CUDA_SUCCESS;
}

/* ---- cuGetProcAddress: (base, version, per-thread flag) -> variant, as the driver does ---- */
struct variant { const char* base; const char* sym; int ver; int pt; void* fn; };
#define V(base, sym, ver, pt) {base, #sym, ver, pt, (void*)&sym}
EXPORT CUresult cuGetProcAddress_v2(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
EXPORT CUresult cuGetProcAddress(const char*, void**, int, cuuint64_t);
static const struct variant table[] = {
  V("cuMemAlloc", cuMemAlloc, 2000, 0), V("cuMemAlloc", cuMemAlloc_v2, 3020, 0),
  V("cuMemAllocPitch", cuMemAllocPitch_v2, 3020, 0), V("cuMemFree", cuMemFree_v2, 3020, 0),
  V("cuMemAllocAsync", cuMemAllocAsync, 11020, 0), V("cuMemAllocAsync", cuMemAllocAsync_ptsz, 11020, 1),
  V("cuMemAllocFromPoolAsync", cuMemAllocFromPoolAsync, 11020, 0),
  V("cuMemAllocFromPoolAsync", cuMemAllocFromPoolAsync_ptsz, 11020, 1),
  V("cuMemFreeAsync", cuMemFreeAsync, 11020, 0), V("cuMemFreeAsync", cuMemFreeAsync_ptsz, 11020, 1),
  V("cuMemAddressReserve", cuMemAddressReserve, 10020, 0), V("cuMemAddressFree", cuMemAddressFree, 10020, 0),
  V("cuMemGetAddressRange", cuMemGetAddressRange_v2, 3020, 0), V("cuMemMap", cuMemMap, 10020, 0),
  V("cuMemUnmap", cuMemUnmap, 10020, 0), V("cuMemCreate", cuMemCreate, 10020, 0),
  V("cuMemSetAccess", cuMemSetAccess, 10020, 0), V("cuMemRelease", cuMemRelease, 10020, 0),
  V("cuStreamSynchronize", cuStreamSynchronize, 2000, 0), V("cuStreamSynchronize", cuStreamSynchronize_ptsz, 7000, 1),
  V("cuLaunchKernel", cuLaunchKernel, 4000, 0), V("cuLaunchKernel", cuLaunchKernel_ptsz, 7000, 1),
  V("cuModuleLoadData", cuModuleLoadData, 2000, 0), V("cuModuleLoadDataEx", cuModuleLoadDataEx, 2010, 0),
  V("cuLibraryLoadData", cuLibraryLoadData, 12000, 0), V("cuInit", cuInit, 2000, 0),
  V("cuCtxGetDevice", cuCtxGetDevice, 2000, 0),
  V("cuGetProcAddress", cuGetProcAddress, 11030, 0), V("cuGetProcAddress", cuGetProcAddress_v2, 12000, 0),
};
static CUresult lookup(const char* symbol, void** pfn, int version, cuuint64_t flags) {
  int want_pt = 0;
  const struct variant* best = NULL;
  if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
    for (size_t i = 0; i < sizeof table / sizeof *table; i++)
      if (table[i].pt && !strcmp(table[i].base, symbol)) want_pt = 1;
  for (size_t i = 0; i < sizeof table / sizeof *table; i++) {
    const struct variant* v = &table[i];
    if (v->pt != want_pt || strcmp(v->base, symbol) || v->ver > version) continue;
    if (!best || v->ver > best->ver) best = v;
  }
  if (!best) { *pfn = NULL; return CUDA_ERROR_NOT_FOUND; }
  *pfn = best->fn;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult* status) {
  char buf[160];
  snprintf(buf, sizeof buf, "cuGetProcAddress_v2(%s,%d,%llu)", symbol ? symbol : "", version, (unsigned long long)flags);
  note(buf);
  if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
  CUresult rc = lookup(symbol, pfn, version, flags);
  if (status) *status = rc == CUDA_SUCCESS ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return rc;
}
EXPORT CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, cuuint64_t flags) {
  note("cuGetProcAddress");
  if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
  return lookup(symbol, pfn, version, flags);
}

/* The stand-in's own address of an entry point, by exact symbol name (tests compare pointers). */
EXPORT void* standin_sym(const char* name) {
  for (size_t i = 0; i < sizeof table / sizeof *table; i++)
    if (!strcmp(table[i].sym, name)) return table[i].fn;
  return NULL;
}

/* ---- graphs: just enough for ember_build_graphs (nodes in order, attributes, edges with edge
 * data). STANDIN_MIXED_EDGES_DROP_DATA=1 drops the edge data of a multi-edge cuGraphAddDependencies
 * call (as driver 580 did); STANDIN_EDGES_DROP_DATA=1 drops it always. Each built graph's nodes
 * and edges can be read back as text with standin_graph_dump. */
struct snode { int type; uint64_t func; unsigned grid[3], block[3], smem; int nattr; int attr[8]; uint64_t arg; };
struct sedge { int src, dst; CUgraphEdgeData d; };
struct sgraph { struct snode* nodes; int n, cap; struct sedge* edges; int ne, ecap; };
static int node_index(struct sgraph* g, CUgraphNode node) {
  intptr_t v = (intptr_t)node;
  return (v >> 20) == ((intptr_t)g & 0xfffff) + 1 ? (int)(v & 0xfffff) - 1 : -1;
}
static CUgraphNode node_handle(struct sgraph* g, int i) {
  return (CUgraphNode)((((intptr_t)g & 0xfffff) + 1) << 20 | (i + 1));
}
/* attribute calls name only the node: it belongs to the graph this thread adds nodes to */
static __thread struct sgraph* cur_graph;
EXPORT CUresult cuGraphCreate(CUgraph* out, unsigned flags) {
  struct sgraph* g = calloc(1, sizeof *g);
  *out = (CUgraph)g;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphDestroy(CUgraph h) {
  struct sgraph* g = (struct sgraph*)h;
  free(g->nodes); free(g->edges); free(g);
  return CUDA_SUCCESS;
}
static CUresult add_node(CUgraphNode* out, CUgraph h, size_t ndeps, struct snode n) {
  struct sgraph* g = (struct sgraph*)h;
  if (!g || ndeps) return CUDA_ERROR_INVALID_VALUE;
  if (g->n == g->cap) { g->cap = g->cap ? 2 * g->cap : 64; g->nodes = realloc(g->nodes, g->cap * sizeof *g->nodes); }
  g->nodes[g->n] = n;
  *out = node_handle(g, g->n++);
  cur_graph = g;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd,
                                        const CUDA_KERNEL_NODE_PARAMS* p) {
  if (!p || !p->func || (!p->kernelParams && !p->extra && getenv("STANDIN_KERNEL_ARGS_REQUIRED")))
    return CUDA_ERROR_INVALID_VALUE;
  struct snode n = {0, (uint64_t)p->func, {p->gridDimX, p->gridDimY, p->gridDimZ},
                    {p->blockDimX, p->blockDimY, p->blockDimZ}, p->sharedMemBytes, 0, {0}, 0};
  return add_node(out, g, nd, n);
}
EXPORT CUresult cuGraphKernelNodeSetAttribute(CUgraphNode node, CUkernelNodeAttrID attr, const CUkernelNodeAttrValue* v) {
  struct sgraph* g = cur_graph;
  int i = g ? node_index(g, node) : -1;
  if (i < 0 || !v || g->nodes[i].nattr == 8) return CUDA_ERROR_INVALID_VALUE;
  g->nodes[i].attr[g->nodes[i].nattr++] = (int)attr;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddMemsetNode(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd,
                                     const CUDA_MEMSET_NODE_PARAMS* p, CUcontext c) {
  struct snode n = {2, 0, {0}, {0}, 0, 0, {0}, p ? (uint64_t)p->dst : 0};
  return p ? add_node(out, g, nd, n) : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuGraphAddMemcpyNode(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd,
                                     const CUDA_MEMCPY3D* p, CUcontext c) {
  struct snode n = {1, 0, {0}, {0}, 0, 0, {0}, p ? (uint64_t)p->dstDevice : 0};
  return p ? add_node(out, g, nd, n) : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuGraphAddEmptyNode(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd) {
  struct snode n = {5, 0, {0}, {0}, 0, 0, {0}, 0};
  return add_node(out, g, nd, n);
}
EXPORT CUresult cuGraphAddChildGraphNode(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd, CUgraph child) {
  struct snode n = {4, 0, {0}, {0}, 0, 0, {0}, (uint64_t)child};
  return child ? add_node(out, g, nd, n) : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuGraphAddEventRecordNode(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd, CUevent e) {
  struct snode n = {7, 0, {0}, {0}, 0, 0, {0}, (uint64_t)e};
  return e ? add_node(out, g, nd, n) : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuGraphAddEventWaitNode(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd, CUevent e) {
  struct snode n = {6, 0, {0}, {0}, 0, 0, {0}, (uint64_t)e};
  return e ? add_node(out, g, nd, n) : CUDA_ERROR_INVALID_VALUE;
}
static CUresult capture_memset(CUdeviceptr dst) {
  CUgraphNode n;
  struct snode node = {2, 0, {0}, {0}, 0, 0, {0}, (uint64_t)dst};
  note("capture:memset");
  return add_node(&n, (CUgraph)capture_graph, 0, node);
}
EXPORT CUresult cuStreamCreate(CUstream* s, unsigned flags) { *s = (CUstream)calloc(1, 16); return CUDA_SUCCESS; }
EXPORT CUresult cuStreamDestroy_v2(CUstream s) { note("cuStreamDestroy_v2"); free(s); return CUDA_SUCCESS; }
EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode) {
  if (capture_graph) return CUDA_ERROR_ILLEGAL_STATE;
  note(mode == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL ? "capture:begin:thread-local" : "capture:begin");
  return cuGraphCreate((CUgraph*)&capture_graph, 0);
}
EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph* g) {
  if (!capture_graph) return CUDA_ERROR_ILLEGAL_STATE;
  *g = (CUgraph)capture_graph;
  capture_graph = NULL;
  note("capture:end");
  return CUDA_SUCCESS;
}
static __thread struct sgraph* query_graph; /* cuGraphNodeGetType answers for the graph last listed */
EXPORT CUresult cuGraphGetNodes(CUgraph h, CUgraphNode* nodes, size_t* count) {
  struct sgraph* g = (struct sgraph*)h;
  query_graph = g;
  if (nodes) for (int i = 0; i < g->n && (size_t)i < *count; i++) nodes[i] = node_handle(g, i);
  *count = (size_t)g->n;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType* t) {
  int i = query_graph ? node_index(query_graph, node) : -1;
  if (i < 0) return CUDA_ERROR_INVALID_VALUE;
  *t = (CUgraphNodeType)query_graph->nodes[i].type;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddDependencies_v2(CUgraph h, const CUgraphNode* from, const CUgraphNode* to,
                                          const CUgraphEdgeData* data, size_t count) {
  struct sgraph* g = (struct sgraph*)h;
  int drop = getenv("STANDIN_EDGES_DROP_DATA") || (count > 1 && getenv("STANDIN_MIXED_EDGES_DROP_DATA"));
  for (size_t e = 0; e < count; e++) {
    int a = node_index(g, from[e]), b = node_index(g, to[e]);
    if (a < 0 || b < 0 || a >= g->n || b >= g->n) return CUDA_ERROR_INVALID_VALUE;
    if (g->ne == g->ecap) { g->ecap = g->ecap ? 2 * g->ecap : 64; g->edges = realloc(g->edges, g->ecap * sizeof *g->edges); }
    struct sedge s = {a, b, {0}};
    if (data && !drop) s.d = data[e];
    g->edges[g->ne++] = s;
  }
  return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphGetEdges_v2(CUgraph h, CUgraphNode* from, CUgraphNode* to, CUgraphEdgeData* data, size_t* n) {
  struct sgraph* g = (struct sgraph*)h;
  if (!from) { *n = (size_t)g->ne; return CUDA_SUCCESS; }
  for (int e = 0; e < g->ne && (size_t)e < *n; e++) {
    from[e] = node_handle(g, g->edges[e].src);
    to[e] = node_handle(g, g->edges[e].dst);
    if (data) data[e] = g->edges[e].d;
  }
  return CUDA_SUCCESS;
}
/* An exec remembers the graph it was instantiated from (node identity, for cuGraphNodeSetEnabled),
 * the graph whose parameters it holds now (the last cuGraphExecUpdate's) and which nodes are
 * disabled. standin_exec_dump prints what a launch would run: the enabled nodes with the
 * parameters it holds. cuGraphExecUpdate refuses another topology (node count and types). */
struct sexec { struct sgraph* from; struct sgraph* holds; unsigned char* off; int n; };
static int execs_alive, exec_updates, enable_calls;
EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec* out, CUgraph h, unsigned long long flags) {
  if (getenv("STANDIN_FAIL_INSTANTIATE")) return CUDA_ERROR_INVALID_VALUE;
  const char* above = getenv("STANDIN_FAIL_INSTANTIATE_ABOVE");  /* graphs of more nodes refused */
  if (above && ((struct sgraph*)h)->n > atoi(above)) return CUDA_ERROR_OUT_OF_MEMORY;
  struct sexec* e = calloc(1, sizeof *e);
  e->from = e->holds = (struct sgraph*)h;
  e->n = e->from->n;
  e->off = calloc((size_t)e->n + 1, 1);
  *out = (CUgraphExec)e;
  __atomic_add_fetch(&execs_alive, 1, __ATOMIC_SEQ_CST);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphExecDestroy(CUgraphExec h) {
  struct sexec* e = (struct sexec*)h;
  if (e) free(e->off);
  free(e);
  __atomic_sub_fetch(&execs_alive, 1, __ATOMIC_SEQ_CST);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec h, CUgraph g, CUgraphExecUpdateResultInfo* info) {
  struct sexec* e = (struct sexec*)h;
  struct sgraph* to = (struct sgraph*)g;
  if (!e || !to) return CUDA_ERROR_INVALID_VALUE;
  if (info) memset(info, 0, sizeof *info);
  const char* above = getenv("STANDIN_FAIL_EXEC_UPDATE_ABOVE");  /* updates to larger graphs refused */
  if (above && to->n > atoi(above)) {
    if (info) info->result = CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED;
    return CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
  }
  int same = to->n == e->n;
  for (int i = 0; same && i < e->n; i++) same = to->nodes[i].type == e->from->nodes[i].type;
  if (!same) {
    if (info) info->result = CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED;
    return CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
  }
  e->holds = to;
  __atomic_add_fetch(&exec_updates, 1, __ATOMIC_SEQ_CST);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphNodeSetEnabled(CUgraphExec h, CUgraphNode node, unsigned on) {
  struct sexec* e = (struct sexec*)h;
  int i = e ? node_index(e->from, node) : -1;
  if (i < 0 || i >= e->n || e->from->nodes[i].type > 2) return CUDA_ERROR_INVALID_VALUE;  /* kernel, memcpy, memset */
  e->off[i] = !on;
  __atomic_add_fetch(&enable_calls, 1, __ATOMIC_SEQ_CST);
  return CUDA_SUCCESS;
}
EXPORT int standin_exec_updates(void) { return exec_updates; }
EXPORT int standin_enable_calls(void) { return enable_calls; }
static size_t dump_node(struct snode* n, char* buf, size_t len, size_t cap);
/* The nodes a launch of the exec would run, as standin_graph_dump prints nodes. */
EXPORT size_t standin_exec_dump(CUgraphExec h, char* buf, size_t cap) {
  struct sexec* e = (struct sexec*)h;
  size_t len = 0;
  for (int i = 0; i < e->n; i++)
    if (!e->off[i]) len = dump_node(&e->holds->nodes[i], buf, len, cap);
  return len;
}
EXPORT int standin_execs_alive(void) { return execs_alive; }
/* "N type func gx gy gz bx smem attrs" per node, then "E src dst from_port to_port type" per edge. */
static size_t dump_node(struct snode* n, char* buf, size_t len, size_t cap) {
  len += snprintf(buf + len, len < cap ? cap - len : 0, "N %d %llu %u %u %u %u %u", n->type,
                  (unsigned long long)(n->func ? n->func : n->arg), n->grid[0], n->grid[1], n->grid[2],
                  n->block[0], n->smem);
  for (int a = 0; a < n->nattr; a++) len += snprintf(buf + len, len < cap ? cap - len : 0, " %d", n->attr[a]);
  return len + snprintf(buf + len, len < cap ? cap - len : 0, "\n");
}
EXPORT size_t standin_graph_dump(CUgraph h, char* buf, size_t cap) {
  struct sgraph* g = (struct sgraph*)h;
  size_t len = 0;
  for (int i = 0; i < g->n; i++) len = dump_node(&g->nodes[i], buf, len, cap);
  for (int e = 0; e < g->ne; e++)
    len += snprintf(buf + len, len < cap ? cap - len : 0, "E %d %d %d %d %d\n", g->edges[e].src, g->edges[e].dst,
                    g->edges[e].d.from_port, g->edges[e].d.to_port, g->edges[e].d.type);
  return len;
}
