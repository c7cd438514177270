// The three ways into the driver (entry points): exported cu* symbols (defined in the hook files), an override
// of dlsym, and cuGetProcAddress / cuGetProcAddress_v2. Also: resolving the real driver once,
// the mode, logging and small helpers shared by the policy files.
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <type_traits>

#include "common.h"

// Declarations of the wrappers (defined, exported, in memory_hooks.cpp / module_hooks.cpp /
// below). The signature of each must equal the driver's type for that ABI variant.
extern "C" {
#define HOOK(sym, base, ver, pt, pfn) std::remove_pointer_t<pfn> sym;
#include "hooks.def"
#undef HOOK
}
#define HOOK(sym, base, ver, pt, pfn)                                  \
  static_assert(std::is_same_v<decltype(&::sym), pfn>, #sym " has the wrong signature");
#include "hooks.def"
#undef HOOK

namespace ember {

const HookInfo kHooks[H_COUNT] = {
#define HOOK(sym, base, ver, pt, pfn) {#sym, #base, ver, pt, reinterpret_cast<void*>(&::sym)},
#include "hooks.def"
#undef HOOK
};

std::atomic<int> g_mode{0};
int g_log_level = 1;

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::Save: return "save";
    case Mode::Load: return "load";
    default: return "off";
  }
}

// ---- logging ----
void log_line(Level lvl, const char* fmt, ...) {
  static const char* names[] = {"error", "warn", "info", "debug"};
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "[ember %d:%ld %s] %s\n", static_cast<int>(getpid()),
          static_cast<long>(syscall(SYS_gettid)), names[static_cast<int>(lvl)], msg);
}

std::string strprintf(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

std::string caller_library(const void* addr) {
  Dl_info info;
  if (addr == nullptr || dladdr(addr, &info) == 0 || info.dli_fname == nullptr) return "?";
  const char* slash = strrchr(info.dli_fname, '/');
  return slash ? slash + 1 : info.dli_fname;
}

uint64_t env_u64(const char* name, uint64_t dflt) {
  const char* v = getenv(name);
  if (v == nullptr || *v == '\0') return dflt;
  char* end = nullptr;
  unsigned long long x = strtoull(v, &end, 0);
  if (end == v) {
    EMBER_LOG(Warn, "Ignored %s=%s (not a number)", name, v);
    return dflt;
  }
  // Suffixes for sizes: K, M, G, T (binary).
  switch (*end) {
    case 'k': case 'K': x <<= 10; break;
    case 'm': case 'M': x <<= 20; break;
    case 'g': case 'G': x <<= 30; break;
    case 't': case 'T': x <<= 40; break;
    default: break;
  }
  return x;
}

// ---- the real dlsym ----
using dlsym_fn = void* (*)(void*, const char*);
static dlsym_fn resolve_real_dlsym() {
  auto f = reinterpret_cast<dlsym_fn>(dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34"));
  if (f == nullptr) f = reinterpret_cast<dlsym_fn>(dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5"));
  return f;
}

void* real_dlsym(void* handle, const char* name) {
  static dlsym_fn f = resolve_real_dlsym();
  return f ? f(handle, name) : nullptr;
}

// ---- resolving the real driver, once ----
static Real g_real;
static const Real* g_real_ptr = nullptr;
static std::once_flag g_real_once;

// Set while this thread resolves the driver: a dlsym from libcuda's own initializers must not
// re-enter the call_once (it would deadlock).
static thread_local bool t_resolving = false;

static void resolve_real() {
  t_resolving = true;
  struct Reset { ~Reset() { t_resolving = false; } } reset;
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (h == nullptr) {
    EMBER_LOG(Info, "No CUDA driver (dlopen libcuda.so.1: %s); ember stays inert", dlerror());
    return;
  }
  int missing = 0;
#define RESOLVE(sym, pfn)                                                        \
  g_real.sym = reinterpret_cast<pfn>(real_dlsym(h, #sym));                       \
  if (g_real.sym == nullptr) {                                                   \
    ++missing;                                                                   \
    EMBER_LOG(Debug, "The driver has no %s", #sym);                              \
  }
#define HOOK(sym, base, ver, pt, pfn) RESOLVE(sym, pfn)
#include "hooks.def"
#undef HOOK
#define USE(sym, pfn) RESOLVE(sym, pfn)
#include "uses.def"
#undef USE
#undef RESOLVE
  if (g_real.cuGetProcAddress_v2 == nullptr) {
    EMBER_LOG(Error, "The driver has no cuGetProcAddress_v2; ember stays inert");
    return;
  }
  EMBER_LOG(Debug, "Resolved the real driver (%d optional symbols missing)", missing);
  g_real_ptr = &g_real;
}

const Real* real() {
  std::call_once(g_real_once, resolve_real);
  return g_real_ptr;
}

int hook_by_symbol(const char* name) {
  if (name == nullptr || name[0] != 'c' || name[1] != 'u') return -1;
  for (int i = 0; i < H_COUNT; ++i)
    if (strcmp(kHooks[i].symbol, name) == 0) return i;
  return -1;
}

// Which wrapper serves (base, version, per-thread flag)? The newest variant whose version is
// <= the requested one, among per-thread variants when the flag asks for them and the base has
// any. Returns -1 when the request falls below every wrapped variant (e.g. the 32-bit
// cuMemAlloc of CUDA 2.x): that one is handed out unwrapped.
int hook_for_request(const char* base, int version, bool per_thread) {
  bool has_pt = false;
  for (int i = 0; i < H_COUNT; ++i)
    if (kHooks[i].per_thread && strcmp(kHooks[i].base, base) == 0) has_pt = true;
  const int want_pt = (per_thread && has_pt) ? 1 : 0;
  int best = -1;
  for (int i = 0; i < H_COUNT; ++i) {
    const HookInfo& h = kHooks[i];
    if (h.per_thread != want_pt || strcmp(h.base, base) != 0 || h.version > version) continue;
    if (best < 0 || h.version > kHooks[best].version) best = i;
  }
  return best;
}

// The real pointer of hook i (hooks.def order), or nullptr.
static void* real_slot(int i) {
  const Real* r = real();
  if (r == nullptr || i < 0 || i >= H_COUNT) return nullptr;
  void* const slots[H_COUNT] = {
#define HOOK(sym, base, ver, pt, pfn) reinterpret_cast<void*>(r->sym),
#include "hooks.def"
#undef HOOK
  };
  return slots[i];
}

// After the real cuGetProcAddress answered: swap its pointer for our wrapper of the same ABI
// variant. Identity first (the driver handed out exactly the exported variant we resolved);
// else the (base, version, flag) table.
static void substitute(const char* symbol, void** pfn, int version, cuuint64_t flags) {
  if (pfn == nullptr || *pfn == nullptr || symbol == nullptr || symbol[0] == '\0') return;
  for (int i = 0; i < H_COUNT; ++i) {
    if (real_slot(i) == *pfn) {
      EMBER_LOG(Debug, "cuGetProcAddress(%s, %d, %llu) -> %s (by identity)", symbol, version,
                static_cast<unsigned long long>(flags), kHooks[i].symbol);
      *pfn = kHooks[i].wrapper;
      return;
    }
  }
  const bool pt = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
  const int i = hook_for_request(symbol, version, pt);
  if (i >= 0 && real_slot(i) != nullptr) {
    EMBER_LOG(Debug, "cuGetProcAddress(%s, %d, %llu) -> %s (by table)", symbol, version,
              static_cast<unsigned long long>(flags), kHooks[i].symbol);
    *pfn = kHooks[i].wrapper;
  }
}

}  // namespace ember

using namespace ember;

extern "C" {

EMBER_EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cudaVersion,
                                          cuuint64_t flags, CUdriverProcAddressQueryResult* status) {
  const Real* r = real();
  if (r == nullptr || r->cuGetProcAddress_v2 == nullptr) return kNoDriver;
  CUresult rc = r->cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, status);
  if (rc == CUDA_SUCCESS) substitute(symbol, pfn, cudaVersion, flags);
  return rc;
}

EMBER_EXPORT CUresult cuGetProcAddress(const char* symbol, void** pfn, int cudaVersion,
                                       cuuint64_t flags) {
  const Real* r = real();
  if (r == nullptr) return kNoDriver;
  CUresult rc;
  if (r->cuGetProcAddress != nullptr) {
    rc = r->cuGetProcAddress(symbol, pfn, cudaVersion, flags);
  } else if (r->cuGetProcAddress_v2 != nullptr) {
    rc = r->cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, nullptr);
  } else {
    return kNoDriver;
  }
  if (rc == CUDA_SUCCESS) substitute(symbol, pfn, cudaVersion, flags);
  return rc;
}

// The dlsym door. The real answer comes first: a name the caller's handle does not provide
// stays NULL. For a wrapped symbol the caller gets our wrapper instead of the driver's.
EMBER_EXPORT void* dlsym(void* handle, const char* name) {
  if (handle == RTLD_NEXT) {
    // The real dlsym would search after libember, not after the caller: emulate the caller's
    // RTLD_NEXT by walking the objects loaded after it.
    Dl_info info;
    const void* ra = __builtin_return_address(0);
    if (dladdr(ra, &info) != 0 && info.dli_fbase != nullptr) {
      struct Ctx { const void* base; bool seen; const char* name; void* found; } ctx{info.dli_fbase, false, name, nullptr};
      dl_iterate_phdr(
          [](dl_phdr_info* pi, size_t, void* data) -> int {
            auto* c = static_cast<Ctx*>(data);
            if (!c->seen) {
              // dli_fbase is the object's load address; dlpi_addr its bias (equal for PIC objects)
              Dl_info di;
              if (pi->dlpi_phnum > 0 &&
                  dladdr(reinterpret_cast<const void*>(pi->dlpi_addr + pi->dlpi_phdr[0].p_vaddr), &di) &&
                  di.dli_fbase == c->base)
                c->seen = true;
              return 0;
            }
            void* h = dlopen(pi->dlpi_name[0] ? pi->dlpi_name : nullptr, RTLD_LAZY | RTLD_NOLOAD);
            if (h == nullptr) return 0;
            c->found = real_dlsym(h, c->name);
            dlclose(h);
            return c->found != nullptr ? 1 : 0;
          },
          &ctx);
      return ctx.found;
    }
  }
  void* p = real_dlsym(handle, name);
  if (p == nullptr) return nullptr;
  const int i = hook_by_symbol(name);
  if (i < 0 || t_resolving || real() == nullptr) return p;
  EMBER_LOG(Debug, "dlsym(%s) -> wrapper", name);
  return kHooks[i].wrapper;
}

}  // extern "C"

// ---- library init: read the environment only; no CUDA call happens here ----
namespace ember {
void allocator_configure_from_env();
}

__attribute__((constructor)) static void ember_init() {
  if (const char* lv = getenv("EMBER_LOG")) {
    if (!strcmp(lv, "error")) g_log_level = 0;
    else if (!strcmp(lv, "warn")) g_log_level = 1;
    else if (!strcmp(lv, "info")) g_log_level = 2;
    else if (!strcmp(lv, "debug")) g_log_level = 3;
  }
  const char* m = getenv("EMBER_MODE");
  if (m != nullptr && (!strcmp(m, "save") || !strcmp(m, "SAVE"))) g_mode = static_cast<int>(Mode::Save);
  else if (m != nullptr && (!strcmp(m, "load") || !strcmp(m, "LOAD"))) g_mode = static_cast<int>(Mode::Load);
  else if (m != nullptr && *m && strcmp(m, "off") != 0)
    EMBER_LOG(Warn, "Ignored EMBER_MODE=%s (expected off, save or load)", m);
  allocator_configure_from_env();
  EMBER_LOG(Info, "Loaded in mode %s", mode_name(mode()));
}
