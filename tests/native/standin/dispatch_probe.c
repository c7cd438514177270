/* Exercises ember's three doors the way libcudart, cuBLAS and Triton reach the driver: dlsym of
 * cuGetProcAddress_v2 then lookups by (base name, version, per-thread flag), dlsym of cu* names,
 * and direct linked calls. Run with LD_PRELOAD=libember.so against the stand-in libcuda.so.1.
 * Prints one line per check; exit status = number of failures. */
#define _GNU_SOURCE
#include <cuda.h>
#undef cuGetProcAddress
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef CUresult (*gpa2_t)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
typedef CUresult (*gpa1_t)(const char*, void**, int, cuuint64_t);
typedef CUresult (*alloc_t)(CUdeviceptr*, size_t);
typedef CUresult (*aalloc_t)(CUdeviceptr*, size_t, CUstream);
typedef CUresult (*afree_t)(CUdeviceptr, CUstream);

static int failures;
static void check(int ok, const char* what) {
  printf("%s %s\n", ok ? "OK" : "FAIL", what);
  if (!ok) failures++;
}

static void* standin;  /* libcuda.so.1 (the stand-in) */
static void* ember;    /* libember.so */
static const char* (*calls)(void);
static void (*reset)(void);
static void* (*sym_of)(const char*);

static int last_call_is(const char* name) {
  const char* c = calls();
  size_t n = strlen(c);
  if (n == 0) return 0;
  const char* end = c + n - 1; /* trailing newline */
  const char* start = end;
  while (start > c && start[-1] != '\n') start--;
  return (size_t)(end - start) == strlen(name) && !strncmp(start, name, strlen(name));
}

int main(void) {
  standin = dlopen("libcuda.so.1", RTLD_NOW);
  ember = dlopen("libember.so", RTLD_NOW | RTLD_NOLOAD);
  if (!standin || !ember) {
    printf("FAIL setup: libcuda %p libember %p (%s)\n", standin, ember, dlerror());
    return 100;
  }
  calls = (const char* (*)(void))dlsym(standin, "standin_calls");
  reset = (void (*)(void))dlsym(standin, "standin_reset");
  sym_of = (void* (*)(const char*))dlsym(standin, "standin_sym");
  check(calls && reset && sym_of, "stand-in helpers visible through dlsym (not wrapped)");
  void* (*ember_sym)(void*, const char*) = dlsym; /* the override itself */
  (void)ember_sym;
  cuInit(0);

  gpa2_t gpa = (gpa2_t)dlsym(standin, "cuGetProcAddress_v2");
  check(gpa == (gpa2_t)dlsym(ember, "cuGetProcAddress_v2"), "dlsym(libcuda, cuGetProcAddress_v2) is ember's");
  void* p = (void*)1;
  CUdriverProcAddressQueryResult st;
  check(gpa("", &p, 0, 0, &st) == CUDA_ERROR_NOT_FOUND, "empty symbol, version 0: the driver's own error");

  check(gpa("cuMemAlloc", &p, 13000, 0, &st) == CUDA_SUCCESS && p == dlsym(ember, "cuMemAlloc_v2"),
        "cuMemAlloc @13000 -> ember cuMemAlloc_v2");
  CUdeviceptr d = 0;
  reset();
  check(((alloc_t)p)(&d, 4096) == CUDA_SUCCESS && last_call_is("cuMemAlloc_v2") && d != 0,
        "wrapped cuMemAlloc_v2 reaches the driver's cuMemAlloc_v2 (mode off)");
  check(gpa("cuMemAlloc", &p, 2000, 0, &st) == CUDA_SUCCESS && p == sym_of("cuMemAlloc"),
        "cuMemAlloc @2000 -> the driver's v1, unwrapped");

  check(gpa("cuMemAllocAsync", &p, 12000, 0, &st) == CUDA_SUCCESS && p == dlsym(ember, "cuMemAllocAsync"),
        "cuMemAllocAsync flags 0 -> ember cuMemAllocAsync");
  reset();
  ((aalloc_t)p)(&d, 4096, NULL);
  check(last_call_is("cuMemAllocAsync"), "  ... which calls the legacy-stream variant");
  check(gpa("cuMemAllocAsync", &p, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st) == CUDA_SUCCESS &&
            p == dlsym(ember, "cuMemAllocAsync_ptsz"),
        "cuMemAllocAsync flags 2 -> ember cuMemAllocAsync_ptsz");
  reset();
  ((aalloc_t)p)(&d, 4096, NULL);
  check(last_call_is("cuMemAllocAsync_ptsz"), "  ... which calls the per-thread variant");
  check(gpa("cuMemFreeAsync", &p, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st) == CUDA_SUCCESS &&
            p == dlsym(ember, "cuMemFreeAsync_ptsz"),
        "cuMemFreeAsync flags 2 -> ember cuMemFreeAsync_ptsz");
  reset();
  ((afree_t)p)(d, NULL);
  check(last_call_is("cuMemFreeAsync_ptsz"), "  ... which calls the per-thread free");
  check(gpa("cuMemFree", &p, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st) == CUDA_SUCCESS &&
            p == dlsym(ember, "cuMemFree_v2"),
        "cuMemFree flags 2 (no per-thread variant) -> ember cuMemFree_v2");

  check(gpa("cuLaunchKernel", &p, 12000, 0, &st) == CUDA_SUCCESS && p == sym_of("cuLaunchKernel"),
        "cuLaunchKernel -> the driver's pointer, no trampoline");
  check(gpa("cuLaunchKernel", &p, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st) == CUDA_SUCCESS &&
            p == sym_of("cuLaunchKernel_ptsz"),
        "cuLaunchKernel flags 2 -> the driver's _ptsz pointer");

  check(gpa("cuGetProcAddress", &p, 12000, 0, &st) == CUDA_SUCCESS && p == dlsym(ember, "cuGetProcAddress_v2"),
        "cuGetProcAddress @12000 -> ember's cuGetProcAddress_v2");
  check(gpa("cuGetProcAddress", &p, 11030, 0, &st) == CUDA_SUCCESS && p == dlsym(ember, "cuGetProcAddress"),
        "cuGetProcAddress @11030 -> ember's cuGetProcAddress (v1 ABI)");
  gpa1_t gpa1 = (gpa1_t)p;
  check(gpa1("cuMemFree", &p, 12000, 0) == CUDA_SUCCESS && p == dlsym(ember, "cuMemFree_v2"),
        "through the v1 door: cuMemFree -> ember cuMemFree_v2");
  check(gpa("cuNoSuchFunction", &p, 12000, 0, &st) == CUDA_ERROR_NOT_FOUND &&
            st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
        "unknown symbol: the driver's status passes through");

  check(dlsym(standin, "cuMemAlloc_v2") == dlsym(ember, "cuMemAlloc_v2"), "dlsym(libcuda, cuMemAlloc_v2) -> ember");
  check(dlsym(standin, "cuLaunchKernel") == sym_of("cuLaunchKernel"), "dlsym(libcuda, cuLaunchKernel) -> driver");
  check(dlsym(standin, "cuNoSuchFunction") == NULL, "dlsym of a missing name stays NULL");
  void* libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
  check(libc && dlsym(libc, "cuMemAlloc_v2") == NULL, "dlsym(libc, cuMemAlloc_v2) stays NULL");
  check(dlsym(RTLD_NEXT, "malloc") == dlsym(libc, "malloc"), "dlsym(RTLD_NEXT, malloc) from the caller -> libc");

  reset();
  check(cuMemAlloc_v2(&d, 8192) == CUDA_SUCCESS && last_call_is("cuMemAlloc_v2"), "linked call cuMemAlloc_v2 works");
  check((void*)&cuMemAlloc_v2 == dlsym(ember, "cuMemAlloc_v2"), "linked cuMemAlloc_v2 binds to ember");
  printf("failures %d\n", failures);
  return failures;
}
