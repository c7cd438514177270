/* Loads one image from several threads at once, as libember's image loaders do, and checks that
 * every function handle the stand-in returned is still valid: prints the invalid ones, exits 1. */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
static const char* IMAGE = ".version 8.0\n.entry k0(\n)\n{\n}\n";
enum { THREADS = 8, LOADS = 120 };
static CUfunction fns[THREADS][LOADS];
static void* work(void* arg) {
  long t = (long)arg;
  for (int i = 0; i < LOADS; i++) {
    CUmodule m;
    if (cuModuleLoadData(&m, IMAGE) != CUDA_SUCCESS || cuModuleGetFunction(&fns[t][i], m, "k0") != CUDA_SUCCESS) return (void*)1;
  }
  return 0;
}
int main(void) {
  pthread_t th[THREADS];
  for (long t = 0; t < THREADS; t++) pthread_create(&th[t], 0, work, (void*)t);
  for (int t = 0; t < THREADS; t++) pthread_join(th[t], 0);
  int lost = 0, v;
  for (int t = 0; t < THREADS; t++)
    for (int i = 0; i < LOADS; i++)
      if (cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fns[t][i]) != CUDA_SUCCESS) lost++;
  printf("%d\n", lost);
  return lost != 0;
}
