// ember_capture_collectives: a rank's real collectives for LOAD's splice (ember/runtime/comm.py,
// docs/multi-gpu.md). Each placeholder of an archive saved on one GPU is captured here, with the
// rank's own NCCL communicator, on a stream of this call, into a CUgraph the graph builder then
// clones into a child-graph node. One call for all of them: per collective it is three driver
// calls and one NCCL call, where the same through ctypes on LOAD's background thread waited for
// the GIL behind the engine's model build at every crossing.
#include <dlfcn.h>

#include <cstring>
#include <string>

#include "common.h"
#include "ember.h"

using namespace ember;

namespace {

typedef int (*AllReduceFn)(const void*, void*, size_t, int, int, void*, CUstream);
typedef int (*GatherFn)(const void*, void*, size_t, int, void*, CUstream);           // all_gather, all_to_all
typedef int (*ReduceFn)(const void*, void*, size_t, int, int, int, void*, CUstream);  // reduce
typedef int (*BroadcastFn)(const void*, void*, size_t, int, int, void*, CUstream);
typedef int (*P2PFn)(void*, size_t, int, int, void*, CUstream);                      // send, recv
typedef int (*GroupFn)();

struct Nccl {
  AllReduceFn all_reduce = nullptr, reduce_scatter = nullptr;
  GatherFn all_gather = nullptr, all_to_all = nullptr;
  ReduceFn reduce = nullptr;
  BroadcastFn broadcast = nullptr;
  P2PFn send = nullptr, recv = nullptr;
  GroupFn group_start = nullptr, group_end = nullptr;
};

// The process's NCCL: the global scope first (a preloaded library), else the libnccl.so.2 torch
// loaded with RTLD_LOCAL.
void* nccl_symbol(const char* name) {
  void* p = dlsym(RTLD_DEFAULT, name);
  if (p == nullptr) {
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    if (h != nullptr) p = dlsym(h, name);
  }
  return p;
}

bool resolve(Nccl* n) {
  n->all_reduce = reinterpret_cast<AllReduceFn>(nccl_symbol("ncclAllReduce"));
  n->reduce_scatter = reinterpret_cast<AllReduceFn>(nccl_symbol("ncclReduceScatter"));
  n->all_gather = reinterpret_cast<GatherFn>(nccl_symbol("ncclAllGather"));
  n->all_to_all = reinterpret_cast<GatherFn>(nccl_symbol("ncclAlltoAll"));
  n->reduce = reinterpret_cast<ReduceFn>(nccl_symbol("ncclReduce"));
  n->broadcast = reinterpret_cast<BroadcastFn>(nccl_symbol("ncclBroadcast"));
  n->send = reinterpret_cast<P2PFn>(nccl_symbol("ncclSend"));
  n->recv = reinterpret_cast<P2PFn>(nccl_symbol("ncclRecv"));
  n->group_start = reinterpret_cast<GroupFn>(nccl_symbol("ncclGroupStart"));
  n->group_end = reinterpret_cast<GroupFn>(nccl_symbol("ncclGroupEnd"));
  return n->all_reduce && n->group_start && n->group_end;
}

int issue(const Nccl& n, const ember_collective& c, void* comm, CUstream s) {
  void* send = reinterpret_cast<void*>(c.send);
  void* recv = reinterpret_cast<void*>(c.recv);
  switch (c.op) {
    case EMBER_COLL_ALL_REDUCE: return n.all_reduce(send, recv, c.count, c.dtype, c.redop, comm, s);
    case EMBER_COLL_ALL_GATHER: return n.all_gather ? n.all_gather(send, recv, c.count, c.dtype, comm, s) : -1;
    case EMBER_COLL_REDUCE_SCATTER:
      return n.reduce_scatter ? n.reduce_scatter(send, recv, c.count, c.dtype, c.redop, comm, s) : -1;
    case EMBER_COLL_ALL_TO_ALL: return n.all_to_all ? n.all_to_all(send, recv, c.count, c.dtype, comm, s) : -1;
    case EMBER_COLL_REDUCE: return n.reduce ? n.reduce(send, recv, c.count, c.dtype, c.redop, c.root, comm, s) : -1;
    case EMBER_COLL_BROADCAST: return n.broadcast ? n.broadcast(send, recv, c.count, c.dtype, c.root, comm, s) : -1;
    case EMBER_COLL_SEND: return n.send ? n.send(send, c.count, c.dtype, c.root, comm, s) : -1;
    case EMBER_COLL_RECV: return n.recv ? n.recv(recv, c.count, c.dtype, c.root, comm, s) : -1;
    default: return -1;
  }
}

// FNV-1a over the node types in order: what the template grouping compares.
uint64_t shape_of(const Real* r, CUgraph g, CUresult* rc) {
  size_t count = 0;
  *rc = r->cuGraphGetNodes(g, nullptr, &count);
  if (*rc != CUDA_SUCCESS) return 0;
  std::string nodes_buf(count * sizeof(CUgraphNode), '\0');
  CUgraphNode* nodes = reinterpret_cast<CUgraphNode*>(nodes_buf.data());
  if (count) *rc = r->cuGraphGetNodes(g, nodes, &count);
  uint64_t h = 1469598103934665603ull ^ count;
  for (size_t i = 0; i < count && *rc == CUDA_SUCCESS; ++i) {
    CUgraphNodeType t;
    *rc = r->cuGraphNodeGetType(nodes[i], &t);
    h = (h ^ static_cast<uint64_t>(t + 1)) * 1099511628211ull;
  }
  return h;
}

int fail(char* err, size_t cap, int status, const std::string& msg) {
  if (err != nullptr && cap > 0) {
    const size_t n = std::min(cap - 1, msg.size());
    memcpy(err, msg.data(), n);
    err[n] = '\0';
  }
  return status;
}

}  // namespace

extern "C" EMBER_EXPORT int ember_capture_collectives(uint64_t ctx, uint64_t comm, const ember_collective* calls,
                                                       const uint32_t* starts, size_t n, uint64_t* graphs,
                                                       uint64_t* shapes, char* err, size_t err_cap) {
  const Real* r = real();
  if (r == nullptr || !r->cuStreamCreate || !r->cuStreamBeginCapture_v2 || !r->cuStreamEndCapture ||
      !r->cuGraphGetNodes || !r->cuGraphNodeGetType || !r->cuGraphDestroy)
    return fail(err, err_cap, EMBER_ENODRIVER, "the driver lacks stream capture entry points");
  if (calls == nullptr || starts == nullptr || graphs == nullptr || shapes == nullptr)
    return fail(err, err_cap, EMBER_EINVAL, "null argument");
  Nccl nccl;
  if (!resolve(&nccl)) return fail(err, err_cap, EMBER_ENOTFOUND, "NCCL is not loaded in this process");
  if (ctx != 0) r->cuCtxSetCurrent(reinterpret_cast<CUcontext>(ctx));
  CUstream s = nullptr;
  CUresult rc = r->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  if (rc != CUDA_SUCCESS) return fail(err, err_cap, EMBER_EDRIVER, "cuStreamCreate failed");
  size_t done = 0;
  int status = EMBER_OK;
  for (; done < n; ++done) {
    // Thread-local capture: the engine's own threads keep allocating while this one captures.
    rc = r->cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    if (rc != CUDA_SUCCESS) {
      status = fail(err, err_cap, EMBER_EDRIVER, strprintf("collective %zu: cuStreamBeginCapture: %d", done, rc));
      break;
    }
    const uint32_t a = starts[done], b = starts[done + 1];
    int nr = (b - a > 1) ? nccl.group_start() : 0;
    for (uint32_t i = a; i < b && nr == 0; ++i) nr = issue(nccl, calls[i], reinterpret_cast<void*>(comm), s);
    if (b - a > 1) {
      const int end = nccl.group_end();
      nr = nr ? nr : end;
    }
    CUgraph g = nullptr;
    rc = r->cuStreamEndCapture(s, &g);
    if (nr != 0 || rc != CUDA_SUCCESS) {
      if (g != nullptr) r->cuGraphDestroy(g);
      status = fail(err, err_cap, nr ? EMBER_EINVAL : EMBER_EDRIVER,
                    strprintf("collective %zu: %s %d", done, nr ? "NCCL error" : "cuStreamEndCapture", nr ? nr : rc));
      break;
    }
    shapes[done] = shape_of(r, g, &rc);
    if (rc != CUDA_SUCCESS) {  // a partial hash would group this collective with another shape
      r->cuGraphDestroy(g);
      status = fail(err, err_cap, EMBER_EDRIVER, strprintf("collective %zu: cuGraphNodeGetType: %d", done, rc));
      break;
    }
    graphs[done] = reinterpret_cast<uint64_t>(g);
  }
  if (r->cuStreamDestroy_v2) r->cuStreamDestroy_v2(s);
  if (status != EMBER_OK) {  // nothing half-done survives
    for (size_t i = 0; i < done; ++i) r->cuGraphDestroy(reinterpret_cast<CUgraph>(graphs[i]));
    for (size_t i = 0; i < n; ++i) graphs[i] = 0;
  }
  return status;
}
