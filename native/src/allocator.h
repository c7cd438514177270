// The deterministic fixed-base layout: one VA region reserved at a fixed base, a bump heap with
// best-fit reuse of coalesced free blocks, VA sub-ranges for callers' own reservations, the event log, and
// record (SAVE) / replay + divergence checks (LOAD). Hook plumbing is in memory_hooks.cpp.
#pragma once

#include <cstdint>
#include <string>

#include "common.h"

namespace ember {

enum class Kind : int { Alloc, Pitch, Async, Pool, Free, FreeAsync, Reserve, Unreserve, Map, Unmap };
const char* kind_name(Kind k);

// Each returns true when ember handled the call (the region served it) and sets *rc; false
// means "not ours": the hook passes the call to the driver unchanged.
bool region_alloc(Kind kind, CUdeviceptr* out, size_t size, size_t align, const void* caller,
                  CUresult* rc);
bool region_free(Kind kind, CUdeviceptr ptr, CUstream stream, const void* caller, CUresult* rc);
bool region_reserve(CUdeviceptr* out, size_t size, size_t align, CUdeviceptr hint,
                    unsigned long long flags, const void* caller, CUresult* rc);
bool region_unreserve(CUdeviceptr ptr, size_t size, const void* caller, CUresult* rc);
bool region_address_range(CUdeviceptr* base, size_t* size, CUdeviceptr ptr, CUresult* rc);
// Logged after the driver mapped/unmapped inside a region reservation.
void region_note_map(CUdeviceptr ptr, size_t size, size_t offset, const void* caller);
void region_note_unmap(CUdeviceptr ptr, size_t size, const void* caller);

// Control (control.cpp wraps these in the C API). Return 0 or a negative ember_status.
int region_arm();
int region_info(uint64_t* base, uint64_t* size, uint64_t* heap_size);
int region_capture_begin();
int region_capture_end();
std::string region_export_log();
int region_import_log(const char* data, size_t len);
int region_replay_window();
// LOAD, before the replay: how many blocks SAVE freed inside the window this process still holds
// (the replay would refuse); `first` describes one. Negative: not in load mode / no log / replayed.
int region_replay_blockers(std::string* first);
bool region_divergence(std::string* msg);
// JSON object WITHOUT its closing brace: control.cpp appends the catalog part.
std::string region_stats_json();
void set_last_error(const std::string& msg);
std::string last_error();

}  // namespace ember
