"""vLLM's CUDA graph keys, enumerated from its configuration without vLLM (torch-free, CPU-tested).

vLLM 0.26 captures graphs for a finite set of batch descriptors that it derives from the
compilation config at start-up; this module mirrors that derivation so SAVE knows every key before
capturing and a test can check it on plain data:

- capture sizes (`VllmConfig._set_cudagraph_sizes`): `[1, 2, 4] + range(8, 256, 8) +
  range(256, max + 1, 16)`, `max = min(2 * max_num_seqs * decode_query_len, 512)` capped by
  `max_num_batched_tokens` (which is added when it fits); explicit sizes are deduplicated and cut at
  `max_num_batched_tokens`;
- V1 runner (`v1/cudagraph_dispatcher.py` `CudagraphDispatcher.initialize_cudagraph_keys`):
  `dict[CUDAGraphMode, set[BatchDescriptor]]`, a mixed-mode descriptor per size (PIECEWISE: no
  request count, not uniform) and, when decode graphs are a separate routine, a FULL uniform
  descriptor per size in `[decode_query_len, decode_query_len * max_num_seqs]`;
- V2 runner (`v1/worker/gpu/cudagraph_utils.py` `CudaGraphManager._init_candidates`):
  `BatchExecutionDescriptor(cg_mode, num_tokens, num_reqs, uniform_token_count, num_active_loras)`,
  decode sizes rounded up to the decode query length.

An ARCHIVE key (`GraphKey`, a tuple of ints) names one captured graph:
`(site, piece, num_tokens, num_reqs or -1, uniform)` where `site` is where the graph lives
(PIECEWISE wrapper entry, V1 FULL wrapper entry, V2 FULL manager graph), `piece` the piecewise
submodule (`PiecewiseBackend.piecewise_compile_index`) and `uniform` the V1 `uniform` flag or the
V2 `uniform_token_count` (0 when None). LoRA adds keys; the adapter refuses LoRA (version check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GraphKey = tuple[int, ...]

# graph sites (the first field of an archive key)
PIECEWISE_ENTRY, V1_FULL_ENTRY, V2_FULL_GRAPH = 1, 2, 3
SITES = {
    PIECEWISE_ENTRY: "piecewise-wrapper",
    V1_FULL_ENTRY: "v1-full-wrapper",
    V2_FULL_GRAPH: "v2-full-manager",
}

NONE, PIECEWISE, FULL = "NONE", "PIECEWISE", "FULL"
# CUDAGraphMode name → (decode mode, mixed mode, separate decode routine), as vllm/config/compilation.py
MODES: dict[str, tuple[str, str, bool]] = {
    "NONE": (NONE, NONE, False),
    "PIECEWISE": (PIECEWISE, PIECEWISE, False),
    "FULL": (FULL, FULL, False),
    "FULL_DECODE_ONLY": (FULL, NONE, True),
    "FULL_AND_PIECEWISE": (FULL, PIECEWISE, True),
}


@dataclass(frozen=True)
class Desc:
    """One batch descriptor as either runner keys it (mode: PIECEWISE or FULL)."""

    mode: str
    num_tokens: int
    num_reqs: int | None
    uniform: int  # V1: 0/1 (BatchDescriptor.uniform); V2: uniform_token_count or 0


@dataclass(frozen=True)
class GraphConfig:
    """What decides the key set: the resolved compilation and scheduler config of one engine."""

    cudagraph_mode: str
    capture_sizes: tuple[int, ...]
    max_capture_size: int
    max_num_seqs: int
    decode_query_len: int = 1  # 1 + speculative tokens
    runner: str = "v1"  # "v1" or "v2"

    @classmethod
    def from_vllm(cls, vllm_config: Any, runner: str) -> GraphConfig:
        """From a vLLM VllmConfig (or any object with the same attributes)."""
        cc, sc = vllm_config.compilation_config, vllm_config.scheduler_config
        mode = getattr(cc.cudagraph_mode, "name", str(cc.cudagraph_mode))
        sizes = tuple(int(s) for s in (cc.cudagraph_capture_sizes or ()))
        spec = getattr(vllm_config, "num_speculative_tokens", 0) or 0
        return cls(
            cudagraph_mode=mode,
            capture_sizes=sizes,
            max_capture_size=int(cc.max_cudagraph_capture_size or (max(sizes) if sizes else 0)),
            max_num_seqs=int(sc.max_num_seqs),
            decode_query_len=1 + int(spec),
            runner=runner,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "cudagraph_mode": self.cudagraph_mode,
            "capture_sizes": list(self.capture_sizes),
            "max_capture_size": self.max_capture_size,
            "max_num_seqs": self.max_num_seqs,
            "decode_query_len": self.decode_query_len,
            "runner": self.runner,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GraphConfig:
        return cls(
            cudagraph_mode=str(d["cudagraph_mode"]),
            capture_sizes=tuple(int(s) for s in d["capture_sizes"]),
            max_capture_size=int(d["max_capture_size"]),
            max_num_seqs=int(d["max_num_seqs"]),
            decode_query_len=int(d.get("decode_query_len", 1)),
            runner=str(d.get("runner", "v1")),
        )


def default_capture_sizes(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    *,
    decode_query_len: int = 1,
    max_capture_size: int | None = None,
    explicit: list[int] | None = None,
) -> list[int]:
    """vLLM 0.26's `cudagraph_capture_sizes` (default performance mode, no sequence parallelism)."""
    top = max_capture_size if max_capture_size is not None else min(max_num_seqs * decode_query_len * 2, 512)
    top = min(max_num_batched_tokens, top)
    if explicit is not None:
        return sorted(i for i in set(explicit) if i <= max_num_batched_tokens)
    sizes = [i for i in (1, 2, 4) if i <= top]
    if top >= 8:
        sizes += list(range(8, min(top + 1, 256), 8))
    if top >= 256:
        sizes += list(range(256, top + 1, 16))
    if max_num_batched_tokens <= top and max_num_batched_tokens not in sizes:
        sizes.append(max_num_batched_tokens)
    return sorted(set(sizes))


def _v1_descs(cfg: GraphConfig) -> list[Desc]:
    """CudagraphDispatcher.initialize_cudagraph_keys without LoRA (every size is a capture size)."""
    decode, mixed, separate = MODES[cfg.cudagraph_mode]
    out: list[Desc] = []
    if mixed != NONE:
        for bs in cfg.capture_sizes:
            if mixed == PIECEWISE:
                out.append(Desc(PIECEWISE, bs, None, 0))
            else:
                out.append(Desc(mixed, bs, min(bs, cfg.max_num_seqs), 0))
    if decode == FULL and separate:
        q = cfg.decode_query_len
        for bs in cfg.capture_sizes:
            if q <= bs <= q * cfg.max_num_seqs:
                out.append(Desc(FULL, bs, min(bs // q, cfg.max_num_seqs), 1))
    return sorted(set(out), key=_order)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _v2_descs(cfg: GraphConfig) -> list[Desc]:
    """CudaGraphManager._init_candidates without LoRA or dynamic speculative decoding."""
    decode, mixed, separate = MODES[cfg.cudagraph_mode]
    q, out = cfg.decode_query_len, []
    for nt in sorted(cfg.capture_sizes):
        if separate and decode != NONE:
            rt = _round_up(nt, q)
            rr = rt // q
            if not (rt > cfg.max_num_seqs * q or rt > cfg.max_capture_size or rr > cfg.max_num_seqs):
                out.append(Desc(decode, rt, rr, q))
        if mixed != NONE:
            out.append(Desc(mixed, nt, min(nt, cfg.max_num_seqs) if mixed == FULL else None, 0))
    return sorted(set(out), key=_order)


def _order(d: Desc) -> tuple[int, int, int]:
    """The engines' capture order: PIECEWISE before FULL, largest first."""
    return (0 if d.mode == PIECEWISE else 1, -d.num_tokens, -(d.num_reqs or 0))


def enumerate_descs(cfg: GraphConfig) -> list[Desc]:
    """Every batch descriptor the engine captures for this config (PIECEWISE first, largest first)."""
    if cfg.cudagraph_mode not in MODES:
        raise ValueError(f"unknown cudagraph mode {cfg.cudagraph_mode!r}")
    return _v2_descs(cfg) if cfg.runner == "v2" else _v1_descs(cfg)


def archive_key(desc: Desc, runner: str, piece: int = 0) -> GraphKey:
    if desc.mode == PIECEWISE:
        site = PIECEWISE_ENTRY
    else:
        site = V2_FULL_GRAPH if runner == "v2" else V1_FULL_ENTRY
        piece = 0
    return (site, piece, desc.num_tokens, -1 if desc.num_reqs is None else desc.num_reqs, desc.uniform)


def desc_of(key: GraphKey) -> Desc:
    site, _, nt, nr, uniform = key
    return Desc(PIECEWISE if site == PIECEWISE_ENTRY else FULL, nt, None if nr < 0 else nr, uniform)


def enumerate_keys(cfg: GraphConfig, pieces: int) -> list[GraphKey]:
    """Every archive key: each PIECEWISE descriptor once per piecewise submodule (`pieces` of
    them), each FULL descriptor once; in capture order."""
    keys: list[GraphKey] = []
    for d in enumerate_descs(cfg):
        if d.mode == PIECEWISE:
            keys.extend(archive_key(d, cfg.runner, p) for p in range(pieces))
        else:
            keys.append(archive_key(d, cfg.runner))
    return keys


def padded_size(cfg: GraphConfig, num_tokens: int) -> int | None:
    """The capture size a batch of `num_tokens` is padded to (None: runs without graphs)."""
    for s in sorted(cfg.capture_sizes):
        if s >= num_tokens:
            return s
    return None
