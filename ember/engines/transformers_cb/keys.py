"""Every CUDA-graph key transformers' continuous-batching scheduler can produce, without CUDA.

transformers 5.17 (`generation/continuous_batching/`) keys its graphs in `input_outputs.py`
`_get_graph_key`:

- decode fast path (block table, flash attention only): ``(num_q_tokens,)`` with num_q_tokens
  padded by `pad_to_pow2(n, max_requests_per_batch)` (`model_runner.py` `maybe_pad_inputs`);
- varlen path: ``(num_q_tokens, max_kv_read, *max_seqlen_k.values())`` where num_q_tokens is
  padded by `pad_to_interval(q, q_padding_interval_size, max_batch_tokens)`, max_kv_read by
  `pad_to_interval(kv, kv_padding_interval_size, num_pages)` and each max_seqlen_k (one per
  attention layer type: full, then sliding) by `pad_to_pow2(s, num_pages, 1024)`
  (`get_model_kwargs`).

The scheduler (`scheduler.py` `_process_candidates`) bounds the unpadded values: q ≤ the token
budget (max_batch_tokens), kv ≤ the cache budget (num_pages), at most max_requests_per_batch
requests of at least one query token each; a request's key length is its past plus its query
(full attention) or its query plus min(past, window - 1) (sliding). `enumerate_keys` returns
every padded key consistent with those bounds: a finite superset of what the scheduler can
produce, which SAVE captures in one pass and LOAD installs, so serving never captures.

Used by `ember.engines.transformers_cb.hooks` (SAVE/LOAD of the engine's graphs) and
`ember bench cb`; pure Python so the arithmetic is unit-tested on any machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from math import ceil, log2
from typing import Any

# The engine's own floor for padded key lengths (`get_model_kwargs`: pad_to_pow2(..., 1024)).
MIN_SEQLEN_K = 1024
FULL, SLIDING = "full_attention", "sliding_attention"

GraphKey = tuple[int, ...]


def pad_to_interval(size: int, interval_size: int, max_value: int) -> int:
    """transformers `utils.pad_to_interval`: next multiple of interval_size, capped (0 → one interval)."""
    if interval_size <= 0:
        return max_value
    padded = ceil(size / interval_size) * interval_size if size > 0 else interval_size
    return min(padded, max_value)


def pad_to_pow2(value: int, max_value: int, min_value: int = 0) -> int:
    """transformers `utils.pad_to_pow2`: next power of two ≥ max(value, min_value, 1), capped."""
    value = max(value, max(1, min_value))
    return min(2 ** ceil(log2(value)), max_value)


@dataclass(frozen=True)
class CBSizing:
    """The resolved engine settings that decide the key set (and the memory layout LOAD rebuilds).

    `num_blocks` and `max_batch_tokens` are what the engine chose after sizing the KV cache from
    free memory; recording them lets LOAD configure the same cache without profiling.
    """

    block_size: int
    num_blocks: int
    max_batch_tokens: int
    max_requests_per_batch: int
    q_padding_interval_size: int
    kv_padding_interval_size: int
    layer_types: tuple[str, ...] = (FULL,)  # order of max_seqlen_k's dict: full first, then sliding
    sliding_window: int = 0
    max_blocks_per_request: int = 0  # > 0: decode fast path (block table) available
    use_cuda_graph_varlen: bool = True
    use_cuda_graph_decode: bool = True
    io_pairs: int = 1  # 2 with async batching: each IO pair has its own graph buffer

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if not self.layer_types or any(t not in (FULL, SLIDING) for t in self.layer_types):
            raise ValueError(
                f"layer_types must be a non-empty tuple of {FULL!r}/{SLIDING!r}, got {self.layer_types}"
            )
        if SLIDING in self.layer_types and self.sliding_window < 1:
            raise ValueError("a sliding_attention layer type needs sliding_window ≥ 1")
        if self.io_pairs not in (1, 2):
            raise ValueError(f"io_pairs must be 1 or 2, got {self.io_pairs}")

    @property
    def num_pages(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def decode_path(self) -> bool:
        return self.max_blocks_per_request > 0 and self.use_cuda_graph_decode

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["layer_types"] = list(self.layer_types)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CBSizing:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown CBSizing fields: {sorted(unknown)}")
        values = dict(data)
        values["layer_types"] = tuple(values.get("layer_types", (FULL,)))
        return cls(**values)


def interval_ladder(interval: int, cap: int) -> list[int]:
    """All values pad_to_interval(x, interval, cap) takes for 0 ≤ x ≤ cap, ascending."""
    if interval <= 0:
        return [cap]
    return sorted({min(k * interval, cap) for k in range(1, ceil(cap / interval) + 1)})


def pow2_ladder(cap: int, floor: int = 1) -> list[int]:
    """All values pad_to_pow2(x, cap, floor) takes for x ≥ 1, ascending."""
    values, p = set(), 2 ** ceil(log2(max(floor, 1)))
    while True:
        values.add(min(p, cap))
        if p >= cap:
            return sorted(values)
        p *= 2


def decode_keys(s: CBSizing) -> list[GraphKey]:
    """Keys of the decode fast path: (pad_to_pow2(n_requests, max_requests_per_batch),)."""
    if not s.decode_path:
        return []
    return [(n,) for n in pow2_ladder(s.max_requests_per_batch)]


def _prev(ladder: list[int], value: int) -> int:
    i = ladder.index(value)
    return ladder[i - 1] if i else 0


def varlen_keys(s: CBSizing) -> list[GraphKey]:
    """Keys of the varlen path: (Q, KV, S_full?, S_sliding?) reachable under the scheduler's bounds."""
    if not s.use_cuda_graph_varlen:
        return []
    q_ladder = interval_ladder(s.q_padding_interval_size, s.max_batch_tokens)
    kv_ladder = interval_ladder(s.kv_padding_interval_size, s.num_pages)
    s_ladder = pow2_ladder(s.num_pages, MIN_SEQLEN_K)
    keys: list[GraphKey] = []
    for q_pad in q_ladder:
        q_lo, q_hi = _prev(q_ladder, q_pad) + 1, q_pad
        for kv_pad in kv_ladder:
            kv_prev = _prev(kv_ladder, kv_pad)
            kv_lo, kv_hi = (kv_prev + 1 if kv_prev else 0), kv_pad
            full_range = _full_seqlen_range(s, q_lo, q_hi, kv_lo, kv_hi)
            per_type: list[list[int]] = []
            for layer_type in s.layer_types:
                if layer_type == FULL:
                    lo, hi = full_range
                else:  # sliding: query + min(past, window - 1), never more than the full length
                    lo, hi = 1, min(full_range[1], q_hi + s.sliding_window - 1)
                padded = sorted(
                    {v for v in s_ladder if pad_to_pow2(lo, s.num_pages, MIN_SEQLEN_K) <= v}
                    & {v for v in s_ladder if v <= pad_to_pow2(hi, s.num_pages, MIN_SEQLEN_K)}
                )
                per_type.append(padded)
            for combo in _product(per_type):
                if len(combo) == 2 and s.layer_types == (FULL, SLIDING) and combo[1] > combo[0]:
                    continue  # sliding length never exceeds the full length of the same request
                keys.append((q_pad, kv_pad, *combo))
    return keys


def _full_seqlen_range(s: CBSizing, q_lo: int, q_hi: int, kv_lo: int, kv_hi: int) -> tuple[int, int]:
    """Smallest and largest max(past_i + q_i) over batches with q in [q_lo, q_hi], kv in [kv_lo, kv_hi].

    n requests (1 ≤ n ≤ min(max_requests_per_batch, q)) share q query and kv past tokens: the
    longest is at least ceil((q + kv) / n) and at most q + kv - (n - 1) (one request takes all but
    one token of each of the others), and never longer than the cache.
    """
    best_lo = None
    for q in {q_lo, q_hi, max(q_lo, min(q_hi, s.max_requests_per_batch))}:
        n = max(1, min(s.max_requests_per_batch, q))
        lo = ceil((q + kv_lo) / n)
        best_lo = lo if best_lo is None else min(best_lo, lo)
    hi = min(q_hi + kv_hi, s.num_pages)
    return max(1, best_lo or 1), max(1, hi)


def _product(lists: list[list[int]]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for values in lists:
        out = [(*prefix, v) for prefix in out for v in values]
    return out


def enumerate_keys(s: CBSizing) -> list[GraphKey]:
    """Every key one IO pair's graph buffer can be asked for: decode keys first, then varlen."""
    return decode_keys(s) + varlen_keys(s)


def key_of_batch(s: CBSizing, queries: list[int], pasts: list[int], decode: bool = False) -> GraphKey:
    """The key the engine computes for one scheduled batch (per-request query and past lengths).

    Mirrors maybe_pad_inputs + prepare_batch_tensors + get_model_kwargs; used by tests and by the
    capture driver to check that a synthetic batch lands on the key it was built for.
    """
    if len(queries) != len(pasts) or not queries:
        raise ValueError("queries and pasts must be non-empty and of equal length")
    q = sum(queries)
    if decode and s.decode_path and all(x == 1 for x in queries):
        return (pad_to_pow2(q, s.max_requests_per_batch),)
    kv = sum(min(p, s.sliding_window) if s.layer_types == (SLIDING,) else p for p in pasts)
    q_pad = pad_to_interval(q, s.q_padding_interval_size, s.max_batch_tokens)
    kv_pad = pad_to_interval(kv, s.kv_padding_interval_size, s.num_pages)
    lengths = []
    for layer_type in s.layer_types:
        if layer_type == FULL:
            longest = max(p + x for p, x in zip(pasts, queries, strict=True))
        else:
            longest = max(x + min(p, s.sliding_window - 1) for p, x in zip(pasts, queries, strict=True))
        lengths.append(pad_to_pow2(longest, s.num_pages, MIN_SEQLEN_K))
    return (q_pad, kv_pad, *lengths)
