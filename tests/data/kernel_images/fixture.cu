// Kernels for ember's kernel-image tests (tests/unit/test_kernel_images.py, tests/gpu/...):
// a kernel calling a device function that is not inlined, one that can fail an assertion (a
// call-graph edge to __assertfail), a plain one, and an unused one to be cut. build.sh compiles it.
#include <cassert>

__device__ float scale[4] = {1.0f, 2.0f, 3.0f, 4.0f};

__device__ __noinline__ float helper(float x) { return x * scale[1] + 1.0f; }

extern "C" __global__ void uses_helper(float* v) { v[threadIdx.x] = helper(v[threadIdx.x]); }

extern "C" __global__ void checks(float* v) {
  assert(v[threadIdx.x] > -1e30f);
  v[threadIdx.x] += 1.0f;
}

extern "C" __global__ void plain(float* v) { v[threadIdx.x] *= 2.0f; }

extern "C" __global__ void unused(float* v, int n) {
  float acc = 0.0f;
  for (int i = 0; i < n; ++i) acc += __sinf(v[(threadIdx.x + i) % 32]) * scale[i % 4];
  v[threadIdx.x] = acc;
}
