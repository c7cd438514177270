/* Diagnostic helper for benchmarks/results/diag/diag_switch.py: set node params on an exec, node by node.
 * Build: gcc -O2 -shared -fPIC -I<dir of cuda.h> diag_switch_set.c -o diag_switch_set.so -ldl
 * set_nodes(exec, dst, src, types, n, ctx, times): for i < n, copy the params of node src[i]
 * (a node of another graph of the same topology) onto exec's node dst[i]; kernel, memset and
 * memcpy nodes only. times[0] = ns spent reading params, times[1] = ns spent setting them.
 * Returns 0, or the index + 1 of the node that failed (negative: a type it does not handle). */
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

typedef CUresult (*kget_t)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS_v2*);
typedef CUresult (*kset_t)(CUgraphExec, CUgraphNode, const CUDA_KERNEL_NODE_PARAMS_v2*);
typedef CUresult (*mget_t)(CUgraphNode, CUDA_MEMSET_NODE_PARAMS*);
typedef CUresult (*mset_t)(CUgraphExec, CUgraphNode, const CUDA_MEMSET_NODE_PARAMS*, CUcontext);
typedef CUresult (*cget_t)(CUgraphNode, CUDA_MEMCPY3D*);
typedef CUresult (*cset_t)(CUgraphExec, CUgraphNode, const CUDA_MEMCPY3D*, CUcontext);

static kget_t kget;
static kset_t kset;
static mget_t mget;
static mset_t mset;
static cget_t cget;
static cset_t cset;

static int64_t now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int init(void) {
  if (kget) return 0;
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!h) return -1;
  kget = (kget_t)dlsym(h, "cuGraphKernelNodeGetParams_v2");
  kset = (kset_t)dlsym(h, "cuGraphExecKernelNodeSetParams_v2");
  mget = (mget_t)dlsym(h, "cuGraphMemsetNodeGetParams");
  mset = (mset_t)dlsym(h, "cuGraphExecMemsetNodeSetParams");
  cget = (cget_t)dlsym(h, "cuGraphMemcpyNodeGetParams");
  cset = (cset_t)dlsym(h, "cuGraphExecMemcpyNodeSetParams");
  return (kget && kset && mget && mset && cget && cset) ? 0 : -1;
}

int64_t set_nodes(uint64_t exec, const uint64_t* dst, const uint64_t* src, const int32_t* types, size_t n,
                  uint64_t ctx, int64_t* times) {
  if (init() != 0) return -1000000;
  CUDA_KERNEL_NODE_PARAMS_v2* kp = calloc(n ? n : 1, sizeof(*kp));
  CUDA_MEMSET_NODE_PARAMS* mp = calloc(n ? n : 1, sizeof(*mp));
  CUDA_MEMCPY3D* cp = calloc(n ? n : 1, sizeof(*cp));
  int64_t rc = 0;
  int64_t t0 = now();
  for (size_t i = 0; i < n && !rc; ++i) {
    CUgraphNode s = (CUgraphNode)(uintptr_t)src[i];
    if (types[i] == CU_GRAPH_NODE_TYPE_KERNEL) rc = kget(s, &kp[i]) ? (int64_t)i + 1 : 0;
    else if (types[i] == CU_GRAPH_NODE_TYPE_MEMSET) rc = mget(s, &mp[i]) ? (int64_t)i + 1 : 0;
    else if (types[i] == CU_GRAPH_NODE_TYPE_MEMCPY) rc = cget(s, &cp[i]) ? (int64_t)i + 1 : 0;
    else rc = -((int64_t)i + 1);
  }
  int64_t t1 = now();
  CUgraphExec ex = (CUgraphExec)(uintptr_t)exec;
  for (size_t i = 0; i < n && !rc; ++i) {
    CUgraphNode d = (CUgraphNode)(uintptr_t)dst[i];
    if (types[i] == CU_GRAPH_NODE_TYPE_KERNEL) rc = kset(ex, d, &kp[i]) ? (int64_t)i + 1 : 0;
    else if (types[i] == CU_GRAPH_NODE_TYPE_MEMSET)
      rc = mset(ex, d, &mp[i], (CUcontext)(uintptr_t)ctx) ? (int64_t)i + 1 : 0;
    else rc = cset(ex, d, &cp[i], (CUcontext)(uintptr_t)ctx) ? (int64_t)i + 1 : 0;
  }
  int64_t t2 = now();
  times[0] = t1 - t0;
  times[1] = t2 - t1;
  free(kp);
  free(mp);
  free(cp);
  return rc;
}
