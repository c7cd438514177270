/* ember's control API: the C ABI of libember.so, used from Python through ctypes
 * (ember/native.py, class Interposer). All functions return 0 on success or a negative
 * ember_status; a message for the last error is available from ember_last_error(). */
#ifndef EMBER_H
#define EMBER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum ember_status {
  EMBER_OK = 0,
  EMBER_EINVAL = -1,     /* bad argument */
  EMBER_EMODE = -2,      /* not allowed in the current mode */
  EMBER_ESTATE = -3,     /* wrong order (e.g. replay before import, arm twice) */
  EMBER_EDIVERGED = -4,  /* the allocation sequence differs from SAVE's */
  EMBER_ENOTFOUND = -5,  /* unknown image, kernel or pointer */
  EMBER_ERANGE = -6,     /* buffer too small: *needed says how much */
  EMBER_EREGION = -7,    /* the region could not be reserved where asked */
  EMBER_EDRIVER = -8,    /* a driver call failed (its CUresult is in the message) */
  EMBER_ENODRIVER = -9,  /* no CUDA driver in this process */
  EMBER_EFORMAT = -10,   /* malformed input (log, image) */
  EMBER_EEDGES = -11,    /* the driver did not keep the edge data it was given */
  EMBER_EUNAVAILABLE = -12, /* an optional system library (libzstd, libcrypto) is missing */
};

int ember_abi_version(void);
/* 0 off, 1 save, 2 load. Setting is allowed only before the region is armed. */
int ember_get_mode(void);
int ember_set_mode(int mode);
int ember_region(uint64_t* base, uint64_t* size, uint64_t* heap_size);
int ember_arm(void);
int ember_capture_begin(void);
int ember_capture_end(void);
/* Byte outputs: copy up to cap bytes into buf, always set *needed. EMBER_ERANGE if cap is short. */
int ember_export_alloc_log(char* buf, size_t cap, size_t* needed);
int ember_import_alloc_log(const char* data, size_t len);
int ember_replay_window(void);
/* Before ember_replay_window: the number of blocks allocated before the capture window that SAVE
 * freed inside it and this process still holds (the replay would refuse; release them first),
 * the first one described in buf. Negative error code outside load mode, without a log, or after
 * the replay. */
int ember_replay_blockers(char* buf, size_t cap);
/* 1 when diverged (message copied), 0 when not. */
int ember_divergence(char* buf, size_t cap);
int ember_last_error(char* buf, size_t cap);
int ember_catalog_json(char* buf, size_t cap, size_t* needed);
/* (image hash, kernel name) of a CUfunction / CUkernel found in a graph node; either may be 0. */
int ember_lookup(uint64_t func, uint64_t kern, char* hash, size_t hash_cap, char* name,
                 size_t name_cap);
int ember_image_bytes(const char* hash, void* buf, size_t cap, size_t* needed);
/* Images in execution order: loaded on worker threads; options_json: {"jit": {opt: value},
 * "library": {opt: value}} with integer keys and values (may be NULL). */
int ember_preload(size_t n, const char* const* hashes, const void* const* data, const size_t* sizes,
                  const char* const* options_json);
int ember_function(const char* hash, const char* name, uint64_t* func);
/* ember_function for n kernels in one call, each given the function attributes SAVE recorded
 * where the loaded function differs: attrs holds EMBER_FUNC_ATTRS values per kernel, in the
 * order max dynamic shared bytes, non-portable cluster size allowed, required cluster width,
 * height, depth, preferred shared-memory carveout; -1 leaves one as loaded. On failure *failed
 * is the kernel's index and the message names it. */
#define EMBER_FUNC_ATTRS 6
int ember_functions(size_t n, const char* const* hashes, const char* const* names, const int32_t* attrs,
                    uint64_t* funcs, size_t* failed);
/* LOAD's kernel-image reader (blob_reader.cpp): reader threads read each blob file of a local
 * archive, check its size and sha256, zstd-decompress it (codec 1; 0 = stored raw), check the raw
 * size and sha256 (when given), and preload it under `hash` (as ember_preload), in order. They
 * read only the first `upto` of ember_read_allow; ember_read_wait waits (at most timeout_ms) until
 * the first `upto` are preloaded and sets *done to how many leading ones are; the first damaged
 * blob stops every reader and is returned by each later wait (its message names the blob).
 * ember_read_close stops the readers, waits for the reads in flight and frees `reads`.
 * EMBER_EUNAVAILABLE: libzstd.so.1 or libcrypto is missing (the caller reads the blobs itself). */
typedef struct ember_blob_read {
  const char* name;          /* the manifest's blob name, for messages */
  const char* hash;          /* the image's content hash (ember_hash_hex) */
  const char* path;
  const char* sha256;        /* hex digest of the stored bytes */
  const char* raw_sha256;    /* hex digest of the uncompressed bytes, or NULL */
  uint64_t stored_size;
  uint64_t raw_size;
  const char* options_json;  /* as ember_preload's; may be NULL */
  int32_t codec;
} ember_blob_read;
int ember_read_images(const ember_blob_read* items, size_t n, int threads, void** reads);
int ember_read_allow(void* reads, size_t upto);
int ember_read_wait(void* reads, size_t upto, uint32_t timeout_ms, size_t* done);
int ember_read_close(void* reads);
int ember_stats_json(char* buf, size_t cap, size_t* needed);
/* Sizes an in-memory image by its magic without reading past readable memory or `limit`
 * bytes (0 = no limit). kind: 1 wrapper, 2 fatbin, 3 elf, 4 ptx. */
int ember_image_size(const void* image, size_t limit, int* kind, size_t* size);
/* The content hash ember keys images by (64-bit, hex). */
int ember_hash_hex(const void* data, size_t len, char* out, size_t cap);


/* ---- graph construction (LOAD's templates; see docs/native.md) ----
 * One graph: its nodes in order, each an op and an argument,
 *   EMBER_OP_KERNEL  arg = address of a CUDA_KERNEL_NODE_PARAMS (v2); attributes
 *                    attr_ids/attr_values[attr_start[i] .. attr_start[i] + attr_count[i]]
 *                    (values: addresses of CUlaunchAttributeValue)
 *   EMBER_OP_MEMSET  arg = address of a CUDA_MEMSET_NODE_PARAMS
 *   EMBER_OP_MEMCPY  arg = address of a CUDA_MEMCPY3D
 *   EMBER_OP_EMPTY   arg unused
 *   EMBER_OP_RECORD, EMBER_OP_WAIT   arg = CUevent
 *   EMBER_OP_CHILD   arg = CUgraph, cloned into a child-graph node (a rank's spliced collective)
 * and its edges (node indices) with 8 bytes of CUgraphEdgeData each, or edge_data NULL when all
 * are default edges. Non-default edges are added one per call, first, then the default edges in
 * one call (a mixed call dropped the edge data on driver 580); when any edge is non-default the
 * edges are read back and compared: a difference is EMBER_EEDGES. Everything the arguments point
 * to must stay alive until the call returns (the driver copies it). */
enum ember_op { EMBER_OP_KERNEL = 0, EMBER_OP_MEMSET, EMBER_OP_MEMCPY, EMBER_OP_EMPTY,
                EMBER_OP_RECORD, EMBER_OP_WAIT, EMBER_OP_CHILD };
enum { EMBER_BUILD_INSTANTIATE = 1 };

typedef struct ember_graph_desc {
  uint32_t nodes;
  uint32_t edges;
  const uint8_t* ops;
  const uint64_t* args;
  const uint32_t* attr_start; /* per node; NULL when no node has attributes */
  const uint32_t* attr_count;
  const uint32_t* attr_ids;
  const uint64_t* attr_values;
  const uint32_t* edge_src;
  const uint32_t* edge_dst;
  const uint8_t* edge_data;   /* 8 bytes per edge, or NULL */
  uint32_t flags;             /* EMBER_BUILD_INSTANTIATE: also instantiate (flags 0) */
  uint64_t* node_handles;     /* optional: filled with each node's CUgraphNode, in node order */
  /* results */
  int32_t status;             /* EMBER_OK or an ember_status */
  int32_t failed_node;        /* the node a failure names, -1 for the graph as a whole */
  uint32_t cu_result;         /* the CUresult of a failed driver call */
  uint64_t graph;             /* CUgraph (the caller destroys it) */
  uint64_t exec;              /* CUgraphExec when instantiated (the caller destroys it) */
  uint64_t build_ns;
  uint64_t instantiate_ns;
  char error[240];
} ember_graph_desc;

/* Builds `n` graphs on up to `threads` worker threads (each made current on `ctx`, a CUcontext).
 * Returns EMBER_OK when every graph was built, else the first failing graph's status; each desc
 * says how it went. A graph whose edge data the driver dropped (EMBER_EEDGES) fails alone; any
 * other failure fails the batch: then no desc holds a graph or exec (all were destroyed). */
int ember_build_graphs(uint64_t ctx, ember_graph_desc* graphs, size_t n, int threads);

/* Sets each of `n` nodes of `exec` enabled (on[i] != 0) or disabled (cuGraphNodeSetEnabled): a
 * union template's slots a member lacks are disabled (ember/archive/union.py). nodes[i] is the
 * CUgraphNode of the graph the exec was instantiated from. Stops at the first refusal (its index
 * in `failed`, when given). */
int ember_exec_enable(uint64_t exec, const uint64_t* nodes, const uint8_t* on, size_t n, size_t* failed);

/* ---- a rank's collectives (LOAD of a multi-GPU archive; docs/multi-gpu.md) ----
 * One NCCL call as SAVE's rank 0 issued it (the archive's collective table); `root` is the root
 * (reduce, broadcast) or the peer (send, recv). Datatype and reduction are NCCL's enum values. */
enum ember_coll_op { EMBER_COLL_ALL_REDUCE = 0, EMBER_COLL_ALL_GATHER, EMBER_COLL_REDUCE_SCATTER,
                     EMBER_COLL_ALL_TO_ALL, EMBER_COLL_REDUCE, EMBER_COLL_BROADCAST, EMBER_COLL_SEND,
                     EMBER_COLL_RECV };
typedef struct ember_collective {
  uint32_t op;
  int32_t dtype;
  int32_t redop;
  int32_t root;
  uint64_t send;
  uint64_t recv;
  uint64_t count;
} ember_collective;

/* Captures `n` collectives with the communicator `comm` (an ncclComm_t of this process's NCCL):
 * collective i is calls[starts[i] .. starts[i+1]) (several calls: one NCCL group), captured on a
 * stream of this call (thread-local capture mode) into its own CUgraph, returned in graphs[i]
 * with shapes[i], a hash of its node types in order. On failure no graph is left (all destroyed)
 * and `err` says which collective and why. */
int ember_capture_collectives(uint64_t ctx, uint64_t comm, const ember_collective* calls,
                              const uint32_t* starts, size_t n, uint64_t* graphs, uint64_t* shapes,
                              char* err, size_t err_cap);

#ifdef __cplusplus
}
#endif
#endif
