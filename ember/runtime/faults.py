"""Faults the tests inject to prove LOAD's canary refuses them: `EMBER_FAULT=name[,name]`.
Nothing sets it outside tests; each name is read where its fault lives.

- `view-offset`: the decode workload's EP layer takes a rank's experts through a view offset, so
  SAVE freezes rank 0's offset into the graphs (a per-rank value frozen at SAVE);
- `stale-update`: an exec update loads the graph the template held before, not the one asked for
  (a stale template update: the template then computes another key's step);
- `splice-redop`: LOAD splices each rank's collectives with a max where the archive's table says
  sum (a wrong splice: the all-reduce and reduce-scatter compute something else);
- `kernel-arg`: LOAD changes every kernel argument of each graph that reads as a float scalar
  (an epsilon, an alpha) to 2x+1, and halves element counts (the last 4-byte argument of 16 or
  more: of every Inductor pointwise kernel, else of the graph's last kernel that has one):
  corrupted kernel arguments in every restored graph, also where Inductor baked every float into
  its kernels (vLLM);
- `own-exec`: the same corruption in the own execs only, the execs the Dedicator swaps in for the
  templates while requests run (a swap that changes results);
- `canary-raise`: the vLLM canary raises on rank 1 before its first step, so rank 1 goes to the
  vote while rank 0 waits in the canary's first collective (a rank failing inside the canary:
  the bound, `EMBER_VLLM_CANARY_TIMEOUT_S`, must end both instead of NCCL's timeout);
- `skip-kernel`: LOAD rebuilds the last kernel node of each graph (one with plain edges only) as
  an empty node: a restored graph that leaves out work, whatever its kernels' arguments are (vLLM's
  compiled graphs have few float scalars for `kernel-arg` to find: Inductor bakes them in);
- `kv-write`: LOAD rebuilds every kernel node that writes tokens' k and v into the paged KV cache
  (`KV_WRITERS`) as an empty node: a FULL graph whose attention then reads a cache its own step
  never wrote (a fault only a step over real KV slots shows: a dummy step's slots are PAD).
"""

from __future__ import annotations

import ctypes
import logging
import struct

import numpy as np

from ember import settings

log = logging.getLogger(__name__)
NAMES = ("view-offset", "stale-update", "splice-redop", "kernel-arg", "own-exec", "skip-kernel",
         "canary-raise", "kv-write")
# vLLM's kernels that write k and v into the paged KV cache, by name (CUDA: `reshape_and_cache_flash`,
# Triton: `reshape_and_cache_kernel_flash`, MLA: `concat_and_cache_mla`)
KV_WRITERS = ("reshape_and_cache", "concat_and_cache")


def active(name: str) -> bool:
    assert name in NAMES, name
    return name in settings.text("EMBER_FAULT").split(",")


def corrupt_arguments(ptrs: np.ndarray, nodes: list[tuple[int, tuple[int, ...]]],
                      names: list[str] | None = None, graph: str = "") -> list[np.ndarray]:
    """`kernel-arg`/`own-exec`: every float scalar among the kernel arguments (a 4-byte argument,
    or a word of an 8-byte one that is not a pointer: a functor's epsilon or alpha) becomes 2x+1,
    and counts are halved (`_halve_counts`); each changed argument in a new buffer its pointer
    (`ptrs`, one per argument) now points to. Returns the buffers, to be kept alive with the graph
    (none: nothing qualified). Every float, not only the first: one scalar may leave what a step
    computes unchanged (a guard, a clamp's bound), and the fault must be a wrong result. `nodes`:
    per kernel node its first slot in `ptrs` and its argument sizes; `names`: the nodes' kernels,
    for the log, and `graph` the graph's key (which graphs a run corrupted: those its launches
    run?). A pointer is never moved and a count only shrinks: the kernel must never touch memory
    it does not own, the fault stays a wrong result, never a crash."""
    bufs, said = [], []
    for n, (first, sizes) in enumerate(nodes):
        for j, size in enumerate(sizes):
            if size not in (4, 8):
                continue
            raw = bytearray(ctypes.string_at(int(ptrs[first + j]), size))
            if size == 8 and _is_pointer(int.from_bytes(raw, "little")):
                continue
            changed = []
            for w in range(0, size, 4):
                word = bytes(raw[w : w + 4])
                (value,) = struct.unpack("<f", word)
                # an integer below 2**24 (a size, an index) reads as a tiny float: skipped
                if int.from_bytes(word, "little") > 0x00FFFFFF and 1e-8 <= abs(value) <= 1e4:
                    raw[w : w + 4] = struct.pack("<f", value * 2 + 1)
                    changed.append(f"argument {j} word {w // 4}: {value!r} -> {value * 2 + 1!r}")
            if changed:
                bufs.append(_repoint(ptrs, first + j, raw))
                said += [f"{names[n] if names else f'kernel node {n}'}: {c}" for c in changed]
    for n, what in _halve_counts(ptrs, nodes, bufs, names):
        said.append(f"{names[n] if names else f'kernel node {n}'}: {what}")
    if said:  # which kernels a run corrupted (a fault that changes nothing shows here)
        log.warning("fault: graph %s: %d kernel argument(s), %s", graph or "?", len(said),
                    "; ".join(said[-4:]))
    return bufs


# Inductor's pointwise kernels (vLLM's compiled graphs): every access is masked by `xnumel`, their
# last scalar argument (constexprs are not passed), so halving it leaves elements unwritten.
POINTWISE = "triton_poi_"


def _halve_counts(ptrs: np.ndarray, nodes: list[tuple[int, tuple[int, ...]]], bufs: list[np.ndarray],
                  names: list[str] | None) -> list[tuple[int, str]]:
    """Counts halved: each Inductor pointwise kernel's, else the last kernel node's (one with a
    count). A count is a node's last 4-byte argument in [16, 2**24): where kernels put theirs
    (Inductor's `xnumel`/`r0_numel`, a norm's hidden size), which a mask compares indices with, so
    the kernel covers part of its range whatever floats its code holds; a count used in index
    arithmetic (`x // ks0`) could reach further, which is why not the first. One count is not
    enough in Inductor's graphs: the last kernel's may cover elements nothing reads (vLLM's V2
    runner, benchmarks/results/h200-20261202b). Returns (node, what changed) per count."""
    pointwise = [n for n, name in enumerate(names or []) if name.startswith(POINTWISE)]
    out = []
    for n in pointwise or reversed(range(len(nodes))):
        first, sizes = nodes[n]
        for j in reversed(range(len(sizes))):
            if sizes[j] != 4:
                continue
            value = int.from_bytes(ctypes.string_at(int(ptrs[first + j]), 4), "little")
            if 16 <= value < 1 << 24:
                bufs.append(_repoint(ptrs, first + j, bytearray((value // 2).to_bytes(4, "little"))))
                where = _pointers(ptrs, first, sizes)
                out.append((n, f"argument {j}: count {value} -> {value // 2} (pointers {where})"))
                break
        if out and not pointwise:
            break
    return out


def _pointers(ptrs: np.ndarray, first: int, sizes: tuple[int, ...]) -> str:
    """The node's pointer arguments, for the log (which memory a corrupted kernel writes)."""
    words = [int.from_bytes(ctypes.string_at(int(ptrs[first + j]), 8), "little")
             for j, size in enumerate(sizes) if size == 8]
    return " ".join(f"{w:#x}" for w in words if _is_pointer(w))


def _is_pointer(word: int) -> bool:
    """An 8-byte argument that reads as a device pointer: its high word a 48-bit address's top bits."""
    return 0 < word >> 32 <= 0xFFFF


def _repoint(ptrs: np.ndarray, slot: int, raw: bytearray) -> np.ndarray:
    buf = np.frombuffer(bytes(raw), dtype=np.uint8).copy()
    ptrs[slot] = buf.ctypes.data
    return buf


def kernel_to_skip(kernel_nodes: np.ndarray, src: np.ndarray, dst: np.ndarray,
                   nondefault: np.ndarray) -> int | None:
    """`skip-kernel`: the last kernel node (index into the graph's nodes) that no non-default edge
    (programmatic, ports) touches, None when there is none. An empty node in its place runs nothing
    and the graph stays buildable: a wrong result, never a crash."""
    special = set(src[nondefault].tolist()) | set(dst[nondefault].tolist())
    for j in reversed(np.asarray(kernel_nodes).tolist()):
        if int(j) not in special:
            return int(j)
    return None


def kv_writes_to_skip(kernel_nodes: np.ndarray, names: list[str], src: np.ndarray, dst: np.ndarray,
                      nondefault: np.ndarray) -> list[int]:
    """`kv-write`: the kernel nodes (indices into the graph's nodes; `names` are theirs, in the same
    order) whose kernel writes the KV cache (`KV_WRITERS`) and that no non-default edge touches."""
    special = set(src[nondefault].tolist()) | set(dst[nondefault].tolist())
    return [int(j) for j, name in zip(np.asarray(kernel_nodes).tolist(), names, strict=True)
            if any(w in name for w in KV_WRITERS) and int(j) not in special]
