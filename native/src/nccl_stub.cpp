// libember_nccl: the communication stub SAVE runs under (LD_PRELOAD after libember) so that ONE
// process on ONE GPU plays rank 0 of a world of N (docs/multi-gpu.md).
//
// It exports the NCCL API that torch's ProcessGroupNCCL links against. Communicator calls
// succeed on a fake communicator that only knows (nranks, rank); every collective becomes a
// PLACEHOLDER: the call is recorded (operation, datatype, count, reduction, root/peer, buffers,
// stream, group) and one 4-byte memset of a scratch word owned by the stub is issued on the
// caller's stream, its value the placeholder's sequence number. Under stream capture that memset
// is a graph node exactly where the collective's kernel would be, with the same dependencies, so
// the graph keeps its topology; LOAD replaces it with the rank's real collective.
//
// Calls inside ncclGroupStart/End form one placeholder (one memset at the outermost GroupEnd),
// as NCCL launches a group as one kernel. No data moves: buffers keep what they held.
//
// The scratch word is allocated with cuMemAlloc from here; libember leaves memory asked for by
// this library (and by libnccl) out of the fixed-base layout (it is per-rank communication
// state), so SAVE and LOAD lay out the engine's memory identically.
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <mutex>
#include <string>
#include <vector>

#define EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// NCCL's ABI, as far as the stub needs it (nccl.h, 2.2x): results, handles, enums are ints.
typedef int ncclResult_t;
enum { ncclSuccess = 0, ncclInternalError = 3, ncclInvalidArgument = 4, ncclInvalidUsage = 5 };
struct ncclUniqueId { char internal[128]; };
typedef void* cudaStream_t;
typedef unsigned long long CUdeviceptr_t;

constexpr uint64_t kCommMagic = 0x454d42455253'5442ull;  // "EMBERSTB"
struct Comm {
  uint64_t magic = kCommMagic;
  int nranks = 1;
  int rank = 0;
  int id = 0;
};

struct Call {
  int seq;       // placeholder sequence number (the memset's value); calls of one group share it
  const char* op;
  const void* send;
  void* recv;
  size_t count;
  int dtype;
  int redop;
  int root;      // root (Reduce/Broadcast) or peer (Send/Recv); -1 otherwise
  int comm;      // the fake communicator's id
  int nranks;
  int rank;
  cudaStream_t stream;
};

struct State {
  std::mutex mu;
  std::vector<Call> calls;
  std::vector<Call> pending;  // calls of the open group
  int group_depth = 0;
  int next_seq = 1;
  int next_comm = 0;
  CUdeviceptr_t scratch = 0;
  std::string last_error;
};

State& stub_state() {
  static State* s = new State();  // never destroyed: NCCL calls may come from exit handlers
  return *s;
}

typedef int (*MemAllocFn)(CUdeviceptr_t*, size_t);
typedef int (*MemsetFn)(CUdeviceptr_t, unsigned int, size_t, void*);

void* driver_symbol(const char* name) {
  // RTLD_DEFAULT reaches libember's cuMemAlloc_v2 first (it is preloaded before us); libember
  // passes this library's allocations through to the driver (see the file comment).
  void* p = dlsym(RTLD_DEFAULT, name);
  if (p == nullptr) {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (h != nullptr) p = dlsym(h, name);
  }
  return p;
}

// The scratch word, allocated on first use (a context is current: the caller launches work).
ncclResult_t ensure_scratch(State& s) {
  if (s.scratch != 0) return ncclSuccess;
  auto alloc = reinterpret_cast<MemAllocFn>(driver_symbol("cuMemAlloc_v2"));
  if (alloc == nullptr || alloc(&s.scratch, 256) != 0) {
    s.last_error = "ember NCCL stub: cannot allocate its scratch word (cuMemAlloc_v2)";
    s.scratch = 0;
    return ncclInternalError;
  }
  return ncclSuccess;
}

ncclResult_t placeholder(State& s, int seq, cudaStream_t stream) {
  ncclResult_t rc = ensure_scratch(s);
  if (rc != ncclSuccess) return rc;
  static MemsetFn memset32 = reinterpret_cast<MemsetFn>(driver_symbol("cuMemsetD32Async"));
  if (memset32 == nullptr || memset32(s.scratch, static_cast<unsigned>(seq), 1, stream) != 0) {
    s.last_error = "ember NCCL stub: cuMemsetD32Async of the placeholder failed";
    return ncclInternalError;
  }
  return ncclSuccess;
}

Comm* comm_of(void* c) {
  Comm* comm = static_cast<Comm*>(c);
  return (comm != nullptr && comm->magic == kCommMagic) ? comm : nullptr;
}

ncclResult_t issue(const char* op, const void* send, void* recv, size_t count, int dtype, int redop, int root,
                   void* c, cudaStream_t stream) {
  Comm* comm = comm_of(c);
  if (comm == nullptr) return ncclInvalidArgument;
  State& s = stub_state();
  std::lock_guard<std::mutex> g(s.mu);
  Call call{0, op, send, recv, count, dtype, redop, root, comm->id, comm->nranks, comm->rank, stream};
  if (s.group_depth > 0) {
    s.pending.push_back(call);
    return ncclSuccess;
  }
  call.seq = s.next_seq++;
  s.calls.push_back(call);
  return placeholder(s, call.seq, stream);
}

ncclResult_t new_comm(void** out, int nranks, int rank) {
  if (out == nullptr || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  State& s = stub_state();
  std::lock_guard<std::mutex> g(s.mu);
  Comm* c = new Comm();
  c->nranks = nranks;
  c->rank = rank;
  c->id = s.next_comm++;
  *out = c;
  return ncclSuccess;
}

// The real libnccl's symbol (for the calls that need no communicator), or null.
template <typename Fn>
Fn real(const char* name) {
  void* p = dlsym(RTLD_NEXT, name);
  if (p == nullptr) {  // loaded as a dependency of a library opened with RTLD_LOCAL (torch)
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    if (h != nullptr) p = dlsym(h, name);
  }
  return reinterpret_cast<Fn>(p);
}

ncclResult_t unsupported(const char* what) {
  State& s = stub_state();
  std::lock_guard<std::mutex> g(s.mu);
  s.last_error = std::string("ember NCCL stub: ") + what + " is not supported while saving";
  fprintf(stderr, "[ember-nccl] %s\n", s.last_error.c_str());
  return ncclInvalidUsage;
}

}  // namespace

// ---- versions, ids, errors ----
EXPORT ncclResult_t ncclGetVersion(int* version) {
  auto fn = real<ncclResult_t (*)(int*)>("ncclGetVersion");  // the real library's: LOAD compares it
  if (fn != nullptr) return fn(version);
  if (version == nullptr) return ncclInvalidArgument;
  *version = 0;
  return ncclSuccess;
}
EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return ncclInvalidArgument;
  memset(id, 0, sizeof(*id));
  strcpy(id->internal, "ember-nccl-stub");
  return ncclSuccess;
}
EXPORT const char* ncclGetErrorString(ncclResult_t rc) {
  auto fn = real<const char* (*)(ncclResult_t)>("ncclGetErrorString");
  return fn != nullptr ? fn(rc) : "ember NCCL stub error";
}
EXPORT const char* ncclGetLastError(void*) {
  State& s = stub_state();
  std::lock_guard<std::mutex> g(s.mu);
  return s.last_error.c_str();
}

// ---- communicators: fake, (nranks, rank) only ----
EXPORT ncclResult_t ncclCommInitRank(void** comm, int nranks, ncclUniqueId, int rank) {
  return new_comm(comm, nranks, rank);
}
EXPORT ncclResult_t ncclCommInitRankConfig(void** comm, int nranks, ncclUniqueId, int rank, void*) {
  return new_comm(comm, nranks, rank);
}
EXPORT ncclResult_t ncclCommInitRankScalable(void** comm, int nranks, int rank, int, ncclUniqueId*, void*) {
  return new_comm(comm, nranks, rank);
}
EXPORT ncclResult_t ncclCommInitAll(void**, int, const int*) { return unsupported("ncclCommInitAll"); }
// A split's size depends on every rank's color: one process cannot know it. Engines that use
// sub-groups must create them with ncclCommInitRank (torch: new_group without split).
EXPORT ncclResult_t ncclCommSplit(void*, int, int, void**, void*) { return unsupported("ncclCommSplit"); }
EXPORT ncclResult_t ncclCommShrink(void*, int*, int, void**, void*, int) { return unsupported("ncclCommShrink"); }
EXPORT ncclResult_t ncclCommFinalize(void* c) { return comm_of(c) ? ncclSuccess : ncclInvalidArgument; }
EXPORT ncclResult_t ncclCommDestroy(void* c) {
  Comm* comm = comm_of(c);
  if (comm == nullptr) return ncclInvalidArgument;
  comm->magic = 0;
  delete comm;
  return ncclSuccess;
}
EXPORT ncclResult_t ncclCommAbort(void* c) { return ncclCommDestroy(c); }
EXPORT ncclResult_t ncclCommGetAsyncError(void* c, ncclResult_t* err) {
  if (comm_of(c) == nullptr || err == nullptr) return ncclInvalidArgument;
  *err = ncclSuccess;
  return ncclSuccess;
}
EXPORT ncclResult_t ncclCommCount(const void* c, int* count) {
  Comm* comm = comm_of(const_cast<void*>(c));
  if (comm == nullptr || count == nullptr) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}
EXPORT ncclResult_t ncclCommUserRank(const void* c, int* rank) {
  Comm* comm = comm_of(const_cast<void*>(c));
  if (comm == nullptr || rank == nullptr) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}
EXPORT ncclResult_t ncclCommCuDevice(const void* c, int* device) {
  if (comm_of(const_cast<void*>(c)) == nullptr || device == nullptr) return ncclInvalidArgument;
  auto get = reinterpret_cast<int (*)(int*)>(driver_symbol("cuCtxGetDevice"));
  return (get != nullptr && get(device) == 0) ? ncclSuccess : ncclInternalError;
}
EXPORT ncclResult_t ncclCommRegister(const void*, void*, size_t, void** handle) {
  if (handle != nullptr) *handle = nullptr;
  return ncclSuccess;
}
EXPORT ncclResult_t ncclCommDeregister(const void*, void*) { return ncclSuccess; }
EXPORT ncclResult_t ncclCommWindowRegister(void*, void*, size_t, void** win, int) {
  return unsupported("ncclCommWindowRegister (symmetric memory)");
}
EXPORT ncclResult_t ncclCommWindowDeregister(void*, void*) { return ncclSuccess; }
EXPORT ncclResult_t ncclDevCommCreate(void*, const void*, void*) { return unsupported("ncclDevCommCreate"); }
EXPORT ncclResult_t ncclDevCommDestroy(void*, const void*) { return ncclSuccess; }
// Device memory for NCCL's own use: the real allocator (no communicator involved); libember
// leaves it out of the layout like all of libnccl's memory.
EXPORT ncclResult_t ncclMemAlloc(void** ptr, size_t size) {
  auto fn = real<ncclResult_t (*)(void**, size_t)>("ncclMemAlloc");
  return fn != nullptr ? fn(ptr, size) : unsupported("ncclMemAlloc");
}
EXPORT ncclResult_t ncclMemFree(void* ptr) {
  auto fn = real<ncclResult_t (*)(void*)>("ncclMemFree");
  return fn != nullptr ? fn(ptr) : unsupported("ncclMemFree");
}
EXPORT ncclResult_t ncclRedOpCreatePreMulSum(int*, void*, int, int, void*) {
  return unsupported("ncclRedOpCreatePreMulSum (a custom reduction)");
}
EXPORT ncclResult_t ncclRedOpDestroy(int, void*) { return ncclSuccess; }

// ---- groups: one placeholder per outermost group ----
EXPORT ncclResult_t ncclGroupStart() {
  State& s = stub_state();
  std::lock_guard<std::mutex> g(s.mu);
  s.group_depth++;
  return ncclSuccess;
}
EXPORT ncclResult_t ncclGroupEnd() {
  State& s = stub_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (s.group_depth == 0) return ncclInvalidUsage;
  if (--s.group_depth > 0 || s.pending.empty()) return ncclSuccess;
  const int seq = s.next_seq++;
  cudaStream_t stream = s.pending.front().stream;
  for (Call& c : s.pending) {
    if (c.stream != stream) {
      s.pending.clear();
      s.last_error = "ember NCCL stub: a group spanning several streams is not supported";
      return ncclInvalidUsage;
    }
    c.seq = seq;
    s.calls.push_back(c);
  }
  s.pending.clear();
  return placeholder(s, seq, stream);
}
EXPORT ncclResult_t ncclGroupSimulateEnd(void*) { return unsupported("ncclGroupSimulateEnd"); }

// ---- collectives: placeholders ----
EXPORT ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, int dtype, int op, void* comm,
                                  cudaStream_t stream) {
  return issue("all_reduce", send, recv, count, dtype, op, -1, comm, stream);
}
EXPORT ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, int dtype, void* comm,
                                  cudaStream_t stream) {
  return issue("all_gather", send, recv, count, dtype, -1, -1, comm, stream);
}
EXPORT ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, int dtype, int op, void* comm,
                                      cudaStream_t stream) {
  return issue("reduce_scatter", send, recv, count, dtype, op, -1, comm, stream);
}
EXPORT ncclResult_t ncclAlltoAll(const void* send, void* recv, size_t count, int dtype, void* comm,
                                 cudaStream_t stream) {
  return issue("all_to_all", send, recv, count, dtype, -1, -1, comm, stream);
}
EXPORT ncclResult_t ncclReduce(const void* send, void* recv, size_t count, int dtype, int op, int root, void* comm,
                               cudaStream_t stream) {
  return issue("reduce", send, recv, count, dtype, op, root, comm, stream);
}
EXPORT ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, int dtype, int root, void* comm,
                                  cudaStream_t stream) {
  return issue("broadcast", send, recv, count, dtype, -1, root, comm, stream);
}
EXPORT ncclResult_t ncclBcast(void* buff, size_t count, int dtype, int root, void* comm, cudaStream_t stream) {
  return issue("broadcast", buff, buff, count, dtype, -1, root, comm, stream);
}
EXPORT ncclResult_t ncclSend(const void* send, size_t count, int dtype, int peer, void* comm, cudaStream_t stream) {
  return issue("send", send, nullptr, count, dtype, -1, peer, comm, stream);
}
EXPORT ncclResult_t ncclRecv(void* recv, size_t count, int dtype, int peer, void* comm, cudaStream_t stream) {
  return issue("recv", nullptr, recv, count, dtype, -1, peer, comm, stream);
}

// ---- control API (ember.runtime.comm reads it with ctypes) ----
EXPORT unsigned long long ember_nccl_scratch() { return stub_state().scratch; }

// The id (the calls' "comm") of the fake communicator at `c`, -1 when it is not one of the stub's:
// an engine with several communicators names the group of each (ember.runtime.comm.stub_comm_id).
EXPORT int ember_nccl_comm_id(void* c) {
  Comm* comm = comm_of(c);
  return comm != nullptr ? comm->id : -1;
}

// Every recorded call, one JSON object per line. Returns the bytes needed; copies when cap allows.
EXPORT size_t ember_nccl_calls(char* buf, size_t cap) {
  State& s = stub_state();
  std::lock_guard<std::mutex> g(s.mu);
  std::string out;
  char line[512];
  for (const Call& c : s.calls) {
    snprintf(line, sizeof(line),
             "{\"seq\":%d,\"op\":\"%s\",\"send\":%llu,\"recv\":%llu,\"count\":%zu,\"dtype\":%d,\"redop\":%d,"
             "\"root\":%d,\"comm\":%d,\"nranks\":%d,\"rank\":%d,\"stream\":%llu}\n",
             c.seq, c.op, static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(c.send)),
             static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(c.recv)), c.count, c.dtype, c.redop, c.root,
             c.comm, c.nranks, c.rank, static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(c.stream)));
    out += line;
  }
  if (buf != nullptr && cap > out.size()) memcpy(buf, out.c_str(), out.size() + 1);
  return out.size() + 1;
}

EXPORT const char* ember_nccl_last_error() { return ncclGetLastError(nullptr); }
