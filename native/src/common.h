// Shared plumbing of libember: the symbol tables generated from hooks.def / uses.def, the mode,
// logging, and small helpers. Policy (allocator, catalog) lives in its own files.
#pragma once

#include <cudaTypedefs.h>
// cuda.h renames cuGetProcAddress to its _v2; ember exports both ABI variants by their own names.
#undef cuGetProcAddress

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#define EMBER_EXPORT __attribute__((visibility("default")))
#define EMBER_HIDDEN __attribute__((visibility("hidden")))

namespace ember {

// ---- symbol tables (one list each: hooks.def, uses.def) ----
enum Hook : int {
#define HOOK(sym, base, ver, pt, pfn) H_##sym,
#include "hooks.def"
#undef HOOK
  H_COUNT
};

struct HookInfo {
  const char* symbol;
  const char* base;
  int version;
  int per_thread;
  void* wrapper;
};
extern const HookInfo kHooks[H_COUNT];

struct Real {
#define HOOK(sym, base, ver, pt, pfn) pfn sym;
#include "hooks.def"
#undef HOOK
#define USE(sym, pfn) pfn sym;
#include "uses.def"
#undef USE
};

// Resolves the real driver once (dlopen("libcuda.so.1")). Returns nullptr when no driver is
// present: every caller must then answer with a driver error code, never call through.
const Real* real();
// real() or nullptr; the error code to return when a real pointer is missing.
constexpr CUresult kNoDriver = CUDA_ERROR_NOT_INITIALIZED;

// Looks up a hook by exact exported symbol name; -1 if not wrapped.
int hook_by_symbol(const char* name);
// The dlsym as glibc implements it (never our override).
void* real_dlsym(void* handle, const char* name);

// ---- mode ----
enum class Mode : int { Off = 0, Save = 1, Load = 2 };
extern std::atomic<int> g_mode;
inline Mode mode() { return static_cast<Mode>(g_mode.load(std::memory_order_relaxed)); }
const char* mode_name(Mode m);

// ---- logging: EMBER_LOG=error|warn|info|debug (default warn); lines carry pid/tid ----
enum class Level : int { Error = 0, Warn = 1, Info = 2, Debug = 3 };
extern int g_log_level;
void log_line(Level lvl, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
#define EMBER_LOG(lvl, ...)                                                     \
  do {                                                                          \
    if (static_cast<int>(::ember::Level::lvl) <= ::ember::g_log_level)          \
      ::ember::log_line(::ember::Level::lvl, __VA_ARGS__);                      \
  } while (0)

// ---- helpers ----
std::string strprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
uint64_t now_ns();
// basename of the shared object containing code address `addr` ("?" when unknown).
std::string caller_library(const void* addr);
uint64_t env_u64(const char* name, uint64_t dflt);
// The message behind the last failed control call (allocator.cpp keeps it).
void set_last_error(const std::string& msg);
std::string last_error();

// f(0), ..., f(n-1) on up to `threads` threads, the calling one among them; returns when all ran.
template <class F>
void parallel_for(size_t n, size_t threads, F&& f) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) f(i);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < std::min(n, threads); ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

}  // namespace ember
