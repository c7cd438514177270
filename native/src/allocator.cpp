// The deterministic fixed-base layout (policy only; the hooks are in memory_hooks.cpp).
//
// Region: [base, base + size), reserved once at arm time at a fixed base.
//   heap     [base, base + heap_size): bump allocator for cuMemAlloc and friends, backed by
//            physical memory ember maps in large pieces (one SetAccess per piece).
//   reserve  [base + heap_size, base + size): VA-only sub-ranges handed out for callers'
//            cuMemAddressReserve(addr=0) (PyTorch expandable segments, NCCL cuMem); the caller
//            maps its own physical memory there.
// Determinism: addresses depend only on the sequence of calls after arming. Freed heap blocks
// are coalesced with free neighbours; a request takes the smallest free block it fits in (lowest
// address among equals), split, before the heap bumps; a free block that ends at the bump cursor
// gives its space back to the bump. (Reuse by exact size only, as before, kept memory freed by an
// allocator's release-and-retry on OOM out of reach of every other size: torch's retry then
// failed where the driver alone would have succeeded.) Async frees wait for their stream
// (outside capture) before the block can be reused; a block freed inside a stream capture is
// never reused.
#include "allocator.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <pthread.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <vector>

#include "ember.h"

namespace ember {

const char* kind_name(Kind k) {
  static const char* names[] = {"alloc", "pitch",   "async",     "pool", "free",
                                "free_async", "reserve", "unreserve", "map",  "unmap"};
  return names[static_cast<int>(k)];
}

static bool kind_from_name(const std::string& s, Kind* k) {
  for (int i = 0; i <= static_cast<int>(Kind::Unmap); ++i)
    if (s == kind_name(static_cast<Kind>(i))) {
      *k = static_cast<Kind>(i);
      return true;
    }
  return false;
}

enum class Phase : int { Pre = 0, Window = 1, Post = 2 };
static const char* phase_name(Phase p) { return p == Phase::Pre ? "pre" : p == Phase::Window ? "window" : "post"; }

struct Event {
  uint64_t seq = 0;
  Kind kind = Kind::Alloc;
  Phase phase = Phase::Pre;
  uint64_t addr = 0, size = 0, align = 0, aux = 0;
  std::string caller;
};

struct Config {
  uint64_t base = 0x600000000000ull;
  uint64_t size = 0;       // 0: heap + 2.5 x device memory
  uint64_t heap_size = 0;  // 0: 1.25 x device memory
  uint64_t map_chunk = 256ull << 20;
  uint64_t premap_piece = 0;  // 0: LOAD premaps SAVE's extent in one piece
  bool manual_arm = false;
};

struct OwnedMap {
  uint64_t addr, size;
};

struct State {
  std::mutex mu;
  Config cfg;
  bool armed = false, failed = false;
  CUdevice dev = 0;
  uint64_t gran = 2ull << 20;
  uint64_t base = 0, size = 0, heap_size = 0;
  uint64_t heap_cursor = 0, mapped_end = 0, resv_cursor = 0;
  std::map<uint64_t, uint64_t> free_heap;                 // addr -> size, coalesced
  std::set<std::pair<uint64_t, uint64_t>> free_by_size;  // (size, addr): best fit
  std::map<uint64_t, std::vector<uint64_t>> free_resv;    // size -> LIFO stack
  std::map<uint64_t, uint64_t> live, resv;                         // addr -> size
  std::vector<OwnedMap> owned_maps;                                // replayed window maps
  std::vector<Event> log;
  Phase phase = Phase::Pre;
  uint64_t pre_count = 0, window_count = 0, heap_high = 0;
  // LOAD: what SAVE recorded.
  bool imported = false, replayed = false;
  std::vector<Event> saved;
  uint64_t saved_pre = 0, saved_window = 0, saved_heap_high = 0;
  uint64_t saved_base = 0, saved_size = 0, saved_heap = 0;
  uint64_t load_checked = 0;  // pre-window events compared so far
  // LOAD: blocks the process freed after its pre-window events, before the replay (torch's
  // empty_cache). They stay live until the replay frees them at SAVE's place in the sequence, or,
  // when SAVE did not free them in the window, until the replay is done.
  std::set<uint64_t> released_early;
  std::string divergence, last_error;
  // stats
  uint64_t bytes_mapped = 0, map_calls = 0, allocs = 0, frees = 0, reserves = 0, bypassed = 0;
  uint64_t ns_arm = 0, ns_map = 0, ns_replay = 0, ns_premap = 0;
};

static State& allocator_state() {
  static State* s = new State();  // never destroyed: hooks may run during exit
  return *s;
}

void set_last_error(const std::string& msg) {
  std::lock_guard<std::mutex> g(allocator_state().mu);
  allocator_state().last_error = msg;
}
std::string last_error() {
  std::lock_guard<std::mutex> g(allocator_state().mu);
  return allocator_state().last_error;
}

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

static std::string cu_err(const Real* r, CUresult rc) {
  const char* s = nullptr;
  if (r && r->cuGetErrorString) r->cuGetErrorString(rc, &s);
  return strprintf("CUresult %d (%s)", static_cast<int>(rc), s ? s : "?");
}

void allocator_configure_from_env() {
  State& s = allocator_state();
  s.cfg.base = env_u64("EMBER_REGION_BASE", s.cfg.base);
  s.cfg.size = env_u64("EMBER_REGION_SIZE", 0);
  s.cfg.heap_size = env_u64("EMBER_HEAP_SIZE", 0);
  s.cfg.map_chunk = env_u64("EMBER_MAP_CHUNK", s.cfg.map_chunk);
  s.cfg.premap_piece = env_u64("EMBER_PREMAP_PIECE", 0);
  const char* arm = getenv("EMBER_ARM");
  s.cfg.manual_arm = arm != nullptr && strcmp(arm, "manual") == 0;
}

// The calling thread's native stack, one log line a frame: who made a call, beyond its library.
static void log_stack() {
  void* frames[48];
  const int n = backtrace(frames, 48);
  for (int i = 2; i < n; ++i) {  // from the frame that called diverge()
    Dl_info info{};
    if (dladdr(frames[i], &info) == 0 || info.dli_fname == nullptr) {
      EMBER_LOG(Error, "  #%d ?", i);
      continue;
    }
    const char* slash = strrchr(info.dli_fname, '/');
    const void* from = info.dli_saddr ? info.dli_saddr : info.dli_fbase;
    EMBER_LOG(Error, "  #%d %s %s+0x%llx", i, slash ? slash + 1 : info.dli_fname,
              info.dli_sname ? info.dli_sname : "?",
              static_cast<unsigned long long>(static_cast<const char*>(frames[i]) - static_cast<const char*>(from)));
  }
}

// Divergence is sticky: the first one is kept, logged once with its stack, and never cleared.
static void diverge(State& s, const std::string& msg_in) {
  if (!s.divergence.empty()) return;
  // the thread that made the differing call: the engine's main thread, or which other
  char thread[32] = {0};
  if (pthread_getname_np(pthread_self(), thread, sizeof thread) != 0 || thread[0] == '\0')
    snprintf(thread, sizeof thread, "?");
  const std::string msg = msg_in + strprintf(" [thread %s]", thread);
  s.divergence = msg;
  s.last_error = "divergence: " + msg;
  EMBER_LOG(Error, "Diverged from SAVE: %s", msg.c_str());
  log_stack();
}

// ---- arming: reserve the region (caller holds the lock) ----
static int arm_locked(State& s) {
  if (s.armed) return EMBER_OK;
  if (s.failed) return EMBER_EREGION;
  const Real* r = real();
  if (r == nullptr) {
    s.last_error = "no CUDA driver";
    return EMBER_ENODRIVER;
  }
  if (mode() == Mode::Off) {
    s.last_error = "arm: mode is off";
    return EMBER_EMODE;
  }
  const uint64_t t0 = now_ns();
  CUdevice dev = 0;
  CUresult rc = r->cuCtxGetDevice ? r->cuCtxGetDevice(&dev) : kNoDriver;
  if (rc != CUDA_SUCCESS) {
    s.last_error = "arm: no current context (" + cu_err(r, rc) + ")";
    return EMBER_ESTATE;
  }
  size_t total = 0;
  if (r->cuDeviceTotalMem_v2 == nullptr || r->cuDeviceTotalMem_v2(&total, dev) != CUDA_SUCCESS) total = 80ull << 30;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  size_t gran = 0;
  if (r->cuMemGetAllocationGranularity &&
      r->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) == CUDA_SUCCESS &&
      gran > 0)
    s.gran = gran;
  const uint64_t gib = 1ull << 30;
  uint64_t heap = s.cfg.heap_size ? s.cfg.heap_size : round_up(total + total / 4, gib);
  heap = round_up(heap, s.gran);
  uint64_t size = s.cfg.size ? s.cfg.size : heap + round_up(total * 5 / 2, gib);
  size = round_up(std::max(size, heap + s.gran), s.gran);
  if (s.cfg.base % s.gran != 0) {
    s.failed = true;
    s.last_error = strprintf("EMBER_REGION_BASE 0x%llx is not a multiple of the granularity 0x%llx",
                             static_cast<unsigned long long>(s.cfg.base), static_cast<unsigned long long>(s.gran));
    EMBER_LOG(Error, "%s; staying pass-through", s.last_error.c_str());
    return EMBER_EREGION;
  }
  CUdeviceptr got = 0;
  rc = r->cuMemAddressReserve ? r->cuMemAddressReserve(&got, size, s.gran, s.cfg.base, 0) : kNoDriver;
  if (rc != CUDA_SUCCESS || got != s.cfg.base) {
    if (rc == CUDA_SUCCESS && r->cuMemAddressFree) r->cuMemAddressFree(got, size);
    s.failed = true;
    s.last_error = rc != CUDA_SUCCESS
                       ? strprintf("reserving %llu bytes at 0x%llx failed: %s", static_cast<unsigned long long>(size),
                                   static_cast<unsigned long long>(s.cfg.base), cu_err(r, rc).c_str())
                       : strprintf("the driver placed the region at 0x%llx, not at 0x%llx (the base is in use)",
                                   static_cast<unsigned long long>(got), static_cast<unsigned long long>(s.cfg.base));
    EMBER_LOG(Error, "Region not armed: %s; staying pass-through", s.last_error.c_str());
    return EMBER_EREGION;
  }
  s.dev = dev;
  s.base = got;
  s.size = size;
  s.heap_size = heap;
  s.heap_cursor = s.mapped_end = got;
  s.resv_cursor = got + heap;
  s.armed = true;
  s.ns_arm += now_ns() - t0;
  EMBER_LOG(Info, "Armed the region at 0x%llx: %llu GiB (heap %llu GiB), device %d, granularity %llu",
            static_cast<unsigned long long>(got), static_cast<unsigned long long>(size >> 30),
            static_cast<unsigned long long>(heap >> 30), dev, static_cast<unsigned long long>(s.gran));
  return EMBER_OK;
}

// Creates physical memory for [addr, addr+size) and makes it accessible: one create, one map,
// one SetAccess for the whole piece.
static CUresult map_physical(State& s, uint64_t addr, uint64_t size) {
  const Real* r = real();
  if (!r || !r->cuMemCreate || !r->cuMemMap || !r->cuMemSetAccess || !r->cuMemRelease) return kNoDriver;
  const uint64_t t0 = now_ns();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = s.dev;
  CUmemGenericAllocationHandle h = 0;
  CUresult rc = r->cuMemCreate(&h, size, &prop, 0);
  if (rc != CUDA_SUCCESS) return rc;
  rc = r->cuMemMap(addr, size, 0, h, 0);
  if (rc != CUDA_SUCCESS) {
    r->cuMemRelease(h);
    return rc;
  }
  CUmemAccessDesc acc{};
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = s.dev;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  rc = r->cuMemSetAccess(addr, size, &acc, 1);
  r->cuMemRelease(h);  // the mapping keeps the memory alive
  if (rc != CUDA_SUCCESS) {
    r->cuMemUnmap(addr, size);
    return rc;
  }
  s.bytes_mapped += size;
  s.map_calls += 1;
  s.ns_map += now_ns() - t0;
  return CUDA_SUCCESS;
}

// Grows the heap's backing so that [.., end) is mapped: at least map_chunk at a time, the exact
// need when memory is short.
static CUresult ensure_mapped(State& s, uint64_t end) {
  if (end <= s.mapped_end) return CUDA_SUCCESS;
  const uint64_t heap_end = s.base + s.heap_size;
  const uint64_t need = round_up(end - s.mapped_end, s.gran);
  uint64_t want = std::min(round_up(std::max(need, s.cfg.map_chunk), s.gran), heap_end - s.mapped_end);
  CUresult rc = map_physical(s, s.mapped_end, want);
  if (rc == CUDA_ERROR_OUT_OF_MEMORY && want > need) rc = map_physical(s, s.mapped_end, want = need);
  if (rc == CUDA_SUCCESS) s.mapped_end += want;
  return rc;
}

static bool ctx_on_region_device(const State& s) {
  const Real* r = real();
  CUdevice d = -1;
  return r && r->cuCtxGetDevice && r->cuCtxGetDevice(&d) == CUDA_SUCCESS && d == s.dev;
}

// Ready to serve a request from the region? Arms on first use unless EMBER_ARM=manual.
static bool usable(State& s) {
  if (mode() == Mode::Off || s.failed) return false;
  if (!s.armed) {
    if (s.cfg.manual_arm) return false;
    if (arm_locked(s) != EMBER_OK) return false;
  }
  return ctx_on_region_device(s);
}

static void check_load(State& s, const Event& e);

static void record(State& s, Kind kind, uint64_t addr, uint64_t size, uint64_t align, uint64_t aux,
                   const void* caller) {
  Event e;
  e.seq = s.log.size();
  e.kind = kind;
  e.phase = s.phase;
  e.addr = addr;
  e.size = size;
  e.align = align;
  e.aux = aux;
  e.caller = caller_library(caller);
  if (s.phase == Phase::Pre) s.pre_count++;
  else if (s.phase == Phase::Window) s.window_count++;
  check_load(s, e);
  s.log.push_back(std::move(e));
}

static bool same_event(const Event& a, const Event& b) {
  return a.kind == b.kind && a.addr == b.addr && a.size == b.size && a.align == b.align;
}

static std::string describe(const Event& e) {
  return strprintf("#%llu %s size=%llu align=%llu addr=0x%llx (from %s)", static_cast<unsigned long long>(e.seq),
                   kind_name(e.kind), static_cast<unsigned long long>(e.size),
                   static_cast<unsigned long long>(e.align), static_cast<unsigned long long>(e.addr),
                   e.caller.c_str());
}

// LOAD: every event before the window must repeat SAVE's pre-window event at the same index.
static void check_load(State& s, const Event& e) {
  if (mode() != Mode::Load || !s.imported || e.phase != Phase::Pre) return;
  const uint64_t i = s.load_checked++;
  if (i >= s.saved_pre) {
    diverge(s, "extra event before the capture window: " + describe(e) +
                   strprintf(" (SAVE made %llu)", static_cast<unsigned long long>(s.saved_pre)));
  } else if (!same_event(s.saved[i], e)) {
    diverge(s, "event " + describe(e) + " differs from SAVE's " + describe(s.saved[i]));
  }
}

// ---- heap and reservation policies ----
static uint64_t heap_align(uint64_t size, uint64_t align) {
  if (align == 0) align = size >= (2ull << 20) ? (2ull << 20) : 512;
  return align;
}

static void free_insert(State& s, uint64_t addr, uint64_t size) {
  s.free_heap[addr] = size;
  s.free_by_size.insert({size, addr});
}

static void free_erase(State& s, std::map<uint64_t, uint64_t>::iterator it) {
  s.free_by_size.erase({it->second, it->first});
  s.free_heap.erase(it);
}

// Smallest free block that holds `rsize` bytes at an `align`ed address (lowest address among
// blocks of one size); split, the pieces before and after stay free.
static bool heap_reuse(State& s, uint64_t rsize, uint64_t align, uint64_t* out) {
  for (auto it = s.free_by_size.lower_bound({rsize, 0}); it != s.free_by_size.end(); ++it) {
    const uint64_t size = it->first, addr = it->second;
    const uint64_t at = round_up(addr, align);
    if (at + rsize > addr + size) continue;
    free_erase(s, s.free_heap.find(addr));
    if (at > addr) free_insert(s, addr, at - addr);
    if (at + rsize < addr + size) free_insert(s, at + rsize, addr + size - (at + rsize));
    *out = at;
    return true;
  }
  return false;
}

static CUresult heap_take(State& s, uint64_t size, uint64_t align, uint64_t* out) {
  const uint64_t rsize = round_up(std::max<uint64_t>(size, 1), 512);
  if (heap_reuse(s, rsize, align, out)) {
    s.live[*out] = rsize;
    return CUDA_SUCCESS;
  }
  const uint64_t addr = round_up(s.heap_cursor, align);
  if (addr + rsize > s.base + s.heap_size) return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult rc = ensure_mapped(s, addr + rsize);
  if (rc != CUDA_SUCCESS) return rc;
  s.heap_cursor = addr + rsize;
  s.heap_high = std::max(s.heap_high, s.heap_cursor - s.base);
  s.live[addr] = rsize;
  *out = addr;
  return CUDA_SUCCESS;
}

// Frees a live block; a reusable one joins its free neighbours (and the bump space when it
// ends at the cursor). The memory stays mapped: it is reused, never returned to the driver.
static bool heap_give(State& s, uint64_t addr, bool reusable) {
  auto it = s.live.find(addr);
  if (it == s.live.end()) return false;
  uint64_t start = addr, end = addr + it->second;
  s.live.erase(it);
  if (!reusable) return true;
  auto next = s.free_heap.lower_bound(end);
  if (next != s.free_heap.end() && next->first == end) {
    end += next->second;
    free_erase(s, next);
  }
  auto prev = s.free_heap.lower_bound(start);
  if (prev != s.free_heap.begin()) {
    --prev;
    if (prev->first + prev->second == start) {
      start = prev->first;
      free_erase(s, prev);
    }
  }
  if (end == s.heap_cursor) {
    s.heap_cursor = start;
  } else {
    free_insert(s, start, end - start);
  }
  return true;
}

static CUresult resv_take(State& s, uint64_t size, uint64_t align, uint64_t* out) {
  align = std::max<uint64_t>(align, s.gran);
  auto it = s.free_resv.find(size);
  if (it != s.free_resv.end()) {
    auto& stack = it->second;
    for (size_t k = stack.size(); k-- > 0;) {
      if (stack[k] % align == 0) {
        *out = stack[k];
        stack.erase(stack.begin() + static_cast<long>(k));
        if (stack.empty()) s.free_resv.erase(it);
        s.resv[*out] = size;
        return CUDA_SUCCESS;
      }
    }
  }
  const uint64_t addr = round_up(s.resv_cursor, align);
  if (addr + size > s.base + s.size) return CUDA_ERROR_OUT_OF_MEMORY;
  s.resv_cursor = addr + size;
  s.resv[addr] = size;
  *out = addr;
  return CUDA_SUCCESS;
}

static bool in_region(const State& s, uint64_t p) { return s.armed && p >= s.base && p < s.base + s.size; }

// ---- hook entry points ----
bool region_alloc(Kind kind, CUdeviceptr* out, size_t size, size_t align, const void* caller, CUresult* rc) {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (!usable(s)) {
    s.bypassed++;
    return false;
  }
  if (out == nullptr) {
    *rc = CUDA_ERROR_INVALID_VALUE;
    return true;
  }
  if (size == 0) {
    *rc = CUDA_ERROR_INVALID_VALUE;
    return true;
  }
  const uint64_t a = heap_align(size, align);
  uint64_t addr = 0;
  *rc = heap_take(s, size, a, &addr);
  if (*rc != CUDA_SUCCESS) {
    EMBER_LOG(Warn, "Region %s of %zu bytes failed: CUresult %d", kind_name(kind), size, static_cast<int>(*rc));
    return true;
  }
  *out = addr;
  s.allocs++;
  record(s, kind, addr, size, a, 0, caller);
  return true;
}

bool region_free(Kind kind, CUdeviceptr ptr, CUstream stream, const void* caller, CUresult* rc) {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (!in_region(s, ptr)) return false;
  // LOAD, every pre-window event matched, replay not yet run: the process gives back a block (torch
  // empties its cache before the replay, as SAVE's did when its first capture started). Kept live
  // here and freed by the replay at SAVE's place, so the window's allocations land where SAVE's
  // did, and the process's allocator never again hands out memory the graphs use.
  if (mode() == Mode::Load && s.imported && !s.replayed && s.phase == Phase::Pre &&
      s.load_checked == s.saved_pre && s.live.count(ptr) && !s.released_early.count(ptr)) {
    s.released_early.insert(ptr);
    *rc = CUDA_SUCCESS;
    return true;
  }
  const Real* r = real();
  uint64_t leaked = 0;
  if (kind == Kind::FreeAsync) {
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    if (r && r->cuStreamIsCapturing && r->cuStreamIsCapturing(stream, &cs) == CUDA_SUCCESS &&
        cs != CU_STREAM_CAPTURE_STATUS_NONE) {
      leaked = 1;  // freed inside a capture: the graph may still use it, never reuse
    } else if (r && r->cuStreamSynchronize) {
      r->cuStreamSynchronize(stream);  // stream order before the block can be reused
    }
  }
  if (!heap_give(s, ptr, leaked == 0)) {
    *rc = CUDA_ERROR_INVALID_VALUE;
    return true;
  }
  s.frees++;
  *rc = CUDA_SUCCESS;
  record(s, kind, ptr, 0, 0, leaked, caller);
  return true;
}

bool region_reserve(CUdeviceptr* out, size_t size, size_t align, CUdeviceptr hint, unsigned long long flags,
                    const void* caller, CUresult* rc) {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (hint != 0 || flags != 0 || !usable(s)) {
    s.bypassed++;
    return false;
  }
  if (out == nullptr || size == 0 || size % s.gran != 0 || (align != 0 && (align & (align - 1)) != 0)) {
    *rc = CUDA_ERROR_INVALID_VALUE;
    return true;
  }
  uint64_t addr = 0;
  *rc = resv_take(s, size, align, &addr);
  if (*rc != CUDA_SUCCESS) return true;
  *out = addr;
  s.reserves++;
  record(s, Kind::Reserve, addr, size, std::max<uint64_t>(align, s.gran), 0, caller);
  return true;
}

bool region_unreserve(CUdeviceptr ptr, size_t size, const void* caller, CUresult* rc) {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (!in_region(s, ptr)) return false;
  auto it = s.resv.find(ptr);
  if (it == s.resv.end() || it->second != size) {
    *rc = CUDA_ERROR_INVALID_VALUE;
    return true;
  }
  s.free_resv[size].push_back(ptr);
  s.resv.erase(it);
  *rc = CUDA_SUCCESS;
  record(s, Kind::Unreserve, ptr, size, 0, 0, caller);
  return true;
}

bool region_address_range(CUdeviceptr* base, size_t* size, CUdeviceptr ptr, CUresult* rc) {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (!in_region(s, ptr) || ptr >= s.base + s.heap_size) return false;  // reservations: the driver knows the maps
  auto it = s.live.upper_bound(ptr);
  if (it == s.live.begin()) {
    *rc = CUDA_ERROR_NOT_FOUND;
    return true;
  }
  --it;
  if (ptr >= it->first + it->second) {
    *rc = CUDA_ERROR_NOT_FOUND;
    return true;
  }
  if (base) *base = it->first;
  if (size) *size = it->second;
  *rc = CUDA_SUCCESS;
  return true;
}

void region_note_map(CUdeviceptr ptr, size_t size, size_t offset, const void* caller) {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (!in_region(s, ptr)) return;
  record(s, Kind::Map, ptr, size, 0, offset, caller);
}

void region_note_unmap(CUdeviceptr ptr, size_t size, const void* caller) {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (!in_region(s, ptr)) return;
  record(s, Kind::Unmap, ptr, size, 0, 0, caller);
}

// ---- control ----
static int premap_saved_extent(State& s);

int region_arm() {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  const bool was = s.armed;
  int rc = arm_locked(s);
  if (rc == EMBER_OK && !was && s.imported) rc = premap_saved_extent(s);
  return rc;
}

int region_info(uint64_t* base, uint64_t* size, uint64_t* heap_size) {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (base) *base = s.armed ? s.base : 0;
  if (size) *size = s.armed ? s.size : 0;
  if (heap_size) *heap_size = s.armed ? s.heap_size : 0;
  return s.armed ? EMBER_OK : (s.failed ? EMBER_EREGION : EMBER_ESTATE);
}

int region_capture_begin() {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (mode() != Mode::Save) {
    s.last_error = "capture_begin: only in save mode (LOAD replays the window instead)";
    return EMBER_EMODE;
  }
  if (!s.armed) {
    s.last_error = "capture_begin: the region is not armed";
    return EMBER_ESTATE;
  }
  if (s.phase != Phase::Pre) {
    s.last_error = "capture_begin: a window was already opened";
    return EMBER_ESTATE;
  }
  s.phase = Phase::Window;
  return EMBER_OK;
}

int region_capture_end() {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (mode() != Mode::Save) {
    s.last_error = "capture_end: only in save mode";
    return EMBER_EMODE;
  }
  if (s.phase != Phase::Window) {
    s.last_error = "capture_end: no open capture window";
    return EMBER_ESTATE;
  }
  s.phase = Phase::Post;
  return EMBER_OK;
}

std::string region_export_log() {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  std::ostringstream o;
  o << std::hex;
  o << "ember-alloclog 1\n";
  o << "region " << s.base << ' ' << s.size << ' ' << s.heap_size << '\n';
  o << "heap_high " << s.heap_high << '\n';
  o << "window " << s.pre_count << ' ' << s.window_count << '\n';
  for (const Event& e : s.log)
    o << "E " << e.seq << ' ' << kind_name(e.kind) << ' ' << phase_name(e.phase) << ' ' << e.addr << ' ' << e.size
      << ' ' << e.align << ' ' << e.aux << ' ' << (e.caller.empty() ? "?" : e.caller) << '\n';
  return o.str();
}

int region_import_log(const char* data, size_t len) {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (mode() != Mode::Load) {
    s.last_error = "import_alloc_log: only in load mode";
    return EMBER_EMODE;
  }
  if (s.imported) {
    s.last_error = "import_alloc_log: a log was already imported";
    return EMBER_ESTATE;
  }
  if (data == nullptr) {
    s.last_error = "import_alloc_log: no data";
    return EMBER_EINVAL;
  }
  std::istringstream in(std::string(data, len));
  in >> std::hex;
  std::string word;
  int version = 0;
  std::vector<Event> ev;
  uint64_t base = 0, size = 0, heap = 0, high = 0, pre = 0, win = 0;
  if (!(in >> word) || word != "ember-alloclog" || !(in >> version) || version != 1) {
    s.last_error = "import_alloc_log: not an ember allocation log (version 1)";
    return EMBER_EFORMAT;
  }
  bool ok = (in >> word) && word == "region" && (in >> base >> size >> heap) && (in >> word) && word == "heap_high" &&
            (in >> high) && (in >> word) && word == "window" && (in >> pre >> win);
  while (ok && (in >> word)) {
    Event e;
    std::string kind, phase;
    if (word != "E" || !(in >> e.seq >> kind >> phase >> e.addr >> e.size >> e.align >> e.aux >> e.caller) ||
        !kind_from_name(kind, &e.kind) || e.seq != ev.size()) {
      ok = false;
      break;
    }
    if (phase == "pre") e.phase = Phase::Pre;
    else if (phase == "window") e.phase = Phase::Window;
    else if (phase == "post") e.phase = Phase::Post;
    else { ok = false; break; }
    ev.push_back(std::move(e));
  }
  if (!ok || pre + win > ev.size()) {
    s.last_error = "import_alloc_log: malformed log";
    return EMBER_EFORMAT;
  }
  for (uint64_t i = 0; i < ev.size(); ++i) {
    const Phase want = i < pre ? Phase::Pre : i < pre + win ? Phase::Window : Phase::Post;
    if (ev[i].phase != want) {
      s.last_error = "import_alloc_log: events out of phase order";
      return EMBER_EFORMAT;
    }
  }
  s.saved = std::move(ev);
  s.saved_pre = pre;
  s.saved_window = win;
  s.saved_heap_high = high;
  s.saved_base = base;
  s.saved_size = size;
  s.saved_heap = heap;
  s.imported = true;
  // Events that happened before the import are checked now, later ones as they happen.
  for (const Event& e : s.log) check_load(s, e);
  if (s.armed && (base != s.base || size != s.size || heap != s.heap_size))
    diverge(s, strprintf("region differs: SAVE 0x%llx+%llx (heap %llx), here 0x%llx+%llx (heap %llx)",
                         static_cast<unsigned long long>(base), static_cast<unsigned long long>(size),
                         static_cast<unsigned long long>(heap), static_cast<unsigned long long>(s.base),
                         static_cast<unsigned long long>(s.size), static_cast<unsigned long long>(s.heap_size)));
  if (s.armed) return premap_saved_extent(s);
  return EMBER_OK;
}

// LOAD: map the heap up to the extent SAVE reached by the window's end, in one piece (one create,
// map and SetAccess). EMBER_PREMAP_PIECE maps it in pieces of that size instead, for diagnosis:
// the pieces do not change a decode step's speed (benchmarks/results/tpot-explained-*.md).
static int premap_saved_extent(State& s) {
  if (!s.divergence.empty()) return EMBER_OK;
  const uint64_t t0 = now_ns();
  const uint64_t end = s.base + std::min(round_up(s.saved_heap_high, s.gran), s.heap_size);
  CUresult rc = CUDA_SUCCESS;
  if (s.cfg.premap_piece > 0) {
    const uint64_t piece = round_up(s.cfg.premap_piece, s.gran);
    while (rc == CUDA_SUCCESS && s.mapped_end < end) rc = ensure_mapped(s, std::min(end, s.mapped_end + piece));
  }
  if (rc == CUDA_SUCCESS) rc = ensure_mapped(s, end);
  s.ns_premap += now_ns() - t0;
  if (rc != CUDA_SUCCESS) {
    s.last_error = "premapping the saved extent failed: " + cu_err(real(), rc);
    EMBER_LOG(Warn, "%s", s.last_error.c_str());
    return EMBER_EDRIVER;
  }
  return EMBER_OK;
}

int region_replay_blockers(std::string* first) {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (mode() != Mode::Load) return EMBER_EMODE;
  if (!s.imported || s.replayed) return EMBER_ESTATE;
  // The replay's own check (below), without replaying: which blocks allocated before the window
  // did SAVE free inside it that this process has not released yet?
  std::set<uint64_t> window_allocated;
  int held = 0;
  for (uint64_t i = s.saved_pre; i < s.saved_pre + s.saved_window; ++i) {
    const Event& e = s.saved[i];
    if (e.kind == Kind::Alloc || e.kind == Kind::Pitch || e.kind == Kind::Async || e.kind == Kind::Pool) {
      window_allocated.insert(e.addr);
    } else if ((e.kind == Kind::Free || e.kind == Kind::FreeAsync) && !window_allocated.count(e.addr) &&
               !s.released_early.count(e.addr)) {
      if (held++ == 0 && first) *first = describe(e);
    }
  }
  return held;
}

int region_replay_window() {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (mode() != Mode::Load) {
    s.last_error = "replay_window: only in load mode";
    return EMBER_EMODE;
  }
  if (!s.imported) {
    s.last_error = "replay_window: import the allocation log first";
    return EMBER_ESTATE;
  }
  if (!s.armed) {
    s.last_error = "replay_window: the region is not armed";
    return EMBER_ESTATE;
  }
  if (s.replayed) {
    s.last_error = "replay_window: already replayed";
    return EMBER_ESTATE;
  }
  if (!s.divergence.empty()) return EMBER_EDIVERGED;
  if (s.pre_count != s.saved_pre) {
    diverge(s, strprintf("%llu events before the capture window, SAVE had %llu",
                         static_cast<unsigned long long>(s.pre_count), static_cast<unsigned long long>(s.saved_pre)));
    return EMBER_EDIVERGED;
  }
  const uint64_t t0 = now_ns();
  s.replayed = true;
  s.phase = Phase::Window;
  const Real* r = real();
  std::set<uint64_t> replay_allocated;
  for (uint64_t i = s.saved_pre; i < s.saved_pre + s.saved_window; ++i) {
    const Event& e = s.saved[i];
    uint64_t got = 0;
    CUresult rc = CUDA_SUCCESS;
    switch (e.kind) {
      case Kind::Alloc: case Kind::Pitch: case Kind::Async: case Kind::Pool:
        rc = heap_take(s, e.size, e.align, &got);
        if (rc == CUDA_SUCCESS) replay_allocated.insert(got);
        break;
      case Kind::Free: case Kind::FreeAsync:
        if (!replay_allocated.count(e.addr) && !s.released_early.count(e.addr)) {
          // Allocated before the window and still the process's: freeing it here would give
          // memory the process may write to the graphs (the aliasing this check exists for).
          diverge(s, strprintf("SAVE freed 0x%llx (allocated before the capture window) inside the "
                               "window, but this process still holds it: release it before "
                               "replay_window (torch.cuda.empty_cache())",
                               static_cast<unsigned long long>(e.addr)));
          s.phase = Phase::Post;
          s.ns_replay += now_ns() - t0;
          return EMBER_EDIVERGED;
        }
        s.released_early.erase(e.addr);
        if (!heap_give(s, e.addr, e.aux == 0)) rc = CUDA_ERROR_INVALID_VALUE;
        got = e.addr;
        break;
      case Kind::Reserve:
        rc = resv_take(s, e.size, e.align, &got);
        break;
      case Kind::Unreserve: {
        auto it = s.resv.find(e.addr);
        if (it == s.resv.end()) rc = CUDA_ERROR_INVALID_VALUE;
        else { s.free_resv[it->second].push_back(e.addr); s.resv.erase(it); }
        got = e.addr;
        break;
      }
      case Kind::Map:
        rc = map_physical(s, e.addr, e.size);
        if (rc == CUDA_SUCCESS) s.owned_maps.push_back({e.addr, e.size});
        got = e.addr;
        break;
      case Kind::Unmap: {
        auto it = std::find_if(s.owned_maps.begin(), s.owned_maps.end(),
                               [&](const OwnedMap& m) { return m.addr == e.addr && m.size == e.size; });
        if (it == s.owned_maps.end()) rc = CUDA_ERROR_INVALID_VALUE;
        else { rc = (r && r->cuMemUnmap) ? r->cuMemUnmap(e.addr, e.size) : kNoDriver; s.owned_maps.erase(it); }
        got = e.addr;
        break;
      }
    }
    if (rc != CUDA_SUCCESS || got != e.addr) {
      diverge(s, rc != CUDA_SUCCESS ? "replaying " + describe(e) + " failed: " + cu_err(r, rc)
                                    : strprintf("replayed %s at 0x%llx, SAVE had it at 0x%llx", kind_name(e.kind),
                                                static_cast<unsigned long long>(got),
                                                static_cast<unsigned long long>(e.addr)));
      s.phase = Phase::Post;
      s.ns_replay += now_ns() - t0;
      return EMBER_EDIVERGED;
    }
    Event copy = e;
    copy.seq = s.log.size();
    s.window_count++;
    s.log.push_back(std::move(copy));
  }
  // Released before the replay but not freed by SAVE's window: the process's own memory, which
  // no graph uses; free for later allocations now.
  for (uint64_t a : s.released_early) heap_give(s, a, true);
  s.released_early.clear();
  s.phase = Phase::Post;
  s.ns_replay += now_ns() - t0;
  EMBER_LOG(Info, "Replayed %llu window events in %.3f ms", static_cast<unsigned long long>(s.saved_window),
            (now_ns() - t0) / 1e6);
  return EMBER_OK;
}

bool region_divergence(std::string* msg) {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (s.divergence.empty()) return false;
  if (msg) *msg = s.divergence;
  return true;
}

std::string region_stats_json() {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  uint64_t live_bytes = 0;
  for (const auto& kv : s.live) live_bytes += kv.second;
  return strprintf(
      "{\"mode\":\"%s\",\"armed\":%s,\"failed\":%s,\"base\":%llu,\"size\":%llu,\"heap_size\":%llu,"
      "\"granularity\":%llu,\"bytes_mapped\":%llu,\"map_calls\":%llu,\"heap_used\":%llu,\"live_bytes\":%llu,"
      "\"allocations\":%llu,\"frees\":%llu,\"reservations\":%llu,\"bypassed\":%llu,\"events\":%llu,"
      "\"pre_window_events\":%llu,\"window_events\":%llu,\"diverged\":%s,"
      "\"seconds\":{\"arm\":%.6f,\"map\":%.6f,\"premap\":%.6f,\"replay\":%.6f}",
      mode_name(mode()), s.armed ? "true" : "false", s.failed ? "true" : "false",
      static_cast<unsigned long long>(s.base), static_cast<unsigned long long>(s.size),
      static_cast<unsigned long long>(s.heap_size), static_cast<unsigned long long>(s.gran),
      static_cast<unsigned long long>(s.bytes_mapped), static_cast<unsigned long long>(s.map_calls),
      static_cast<unsigned long long>(s.heap_cursor - s.base), static_cast<unsigned long long>(live_bytes),
      static_cast<unsigned long long>(s.allocs), static_cast<unsigned long long>(s.frees),
      static_cast<unsigned long long>(s.reserves), static_cast<unsigned long long>(s.bypassed),
      static_cast<unsigned long long>(s.log.size()), static_cast<unsigned long long>(s.pre_count),
      static_cast<unsigned long long>(s.window_count), s.divergence.empty() ? "false" : "true", s.ns_arm / 1e9,
      s.ns_map / 1e9, s.ns_premap / 1e9, s.ns_replay / 1e9);
}

int set_mode_checked(int m) {
  State& s = allocator_state();
  std::lock_guard<std::mutex> g(s.mu);
  if (m < 0 || m > 2) {
    s.last_error = "set_mode: expected 0 (off), 1 (save) or 2 (load)";
    return EMBER_EINVAL;
  }
  if (s.armed && m != g_mode.load()) {
    s.last_error = "set_mode: the region is armed; the mode is fixed";
    return EMBER_ESTATE;
  }
  g_mode = m;
  return EMBER_OK;
}

}  // namespace ember
