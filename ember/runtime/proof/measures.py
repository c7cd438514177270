"""The torch-free half of SAVE's proof and of the benchmark's token verdicts (CPU-testable).

- edge multisets WITH edge data (`edge_problems`): a programmatic edge rebuilt as a default one
  is a difference, never tolerated;
- the native run-to-run spread of a graph's outputs and whether a rebuilt replay lies within it
  (`spread_of`, `within_spread`), from per-output deviations computed on the GPU by prove.py
  (0 = bit-identical; max |a-b| for floating outputs; differing elements for integer ones);
- kernels that only the non-bit-stable graphs use (`suspect_kernels`);
- per-step token hashes and the first step where two decodes part (`step_hashes`,
  `first_divergence`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

from ember.archive.graphs import GraphSet, NodeType

SPREAD_FACTOR = 2.0  # a rebuilt replay may deviate up to this multiple of the native spread


def _edge_key(e: Any) -> tuple[int, int, int, int, int]:
    return (int(e.src), int(e.dst), int(e.from_port), int(e.to_port), int(e.type))


def edge_problems(captured: Iterable[Any], rebuilt: Iterable[Any]) -> list[str]:
    """Edges compared as multisets of (src, dst, from_port, to_port, type); empty = identical."""
    cap, reb = sorted(map(_edge_key, captured)), sorted(map(_edge_key, rebuilt))
    if cap == reb:
        return []
    prog_cap = sum(e[4] == 1 for e in cap)
    prog_reb = sum(e[4] == 1 for e in reb)
    same_deps = sorted(e[:2] for e in cap) == sorted(e[:2] for e in reb)
    what = "edge data differs" if same_deps else "edges differ"
    return [
        f"{what}: {len(reb)} rebuilt vs {len(cap)} captured "
        f"(programmatic {prog_reb} rebuilt vs {prog_cap} captured)"
    ]


def spread_of(pair_deviations: Sequence[Sequence[float]], outputs: int) -> list[float]:
    """Per output, the largest deviation between any two native replays (all 0 = bit-stable)."""
    spread = [0.0] * outputs
    for dev in pair_deviations:
        spread = [max(s, float(d)) for s, d in zip(spread, dev, strict=True)]
    return spread


def within_spread(
    to_natives: Sequence[Sequence[float]], spread: Sequence[float], factor: float = SPREAD_FACTOR
) -> tuple[bool, list[float]]:
    """Is a rebuilt replay as close to the native replays as they are to each other?

    `to_natives[k][j]` is output j's deviation from native replay k. Per output, the deviation to
    the NEAREST native replay must be <= factor x the native spread, so an output that is
    bit-stable natively must be bit-identical. Returns (ok, nearest deviations)."""
    nearest = [min(float(d) for d in col) for col in zip(*to_natives, strict=True)]
    ok = all(d <= factor * s for d, s in zip(nearest, spread, strict=True))
    return ok, nearest


def suspect_kernels(graph_set: GraphSet, unstable: set[tuple[int, ...]]) -> list[str]:
    """Kernel names that occur only in the graphs whose native replays are not bit-stable."""
    used_stable: set[int] = set()
    used_unstable: set[int] = set()
    for g in graph_set.graphs:
        ks = {n.params.kernel for n in g.nodes if n.type == NodeType.KERNEL}  # type: ignore[union-attr]
        (used_unstable if tuple(g.key) in unstable else used_stable).update(ks)
    return sorted({graph_set.kernels[k].name for k in used_unstable - used_stable})


def step_hashes(rows: Iterable[Any]) -> list[str]:
    """Short hashes of each decode step's tokens (rows of a [steps, batch] integer array)."""
    return [hashlib.sha256(r.tobytes() if hasattr(r, "tobytes") else bytes(r)).hexdigest()[:10] for r in rows]


def first_divergence(a: Sequence[str] | None, b: Sequence[str] | None) -> int | None:
    """Index of the first decode step whose tokens differ (None: identical or not comparable)."""
    if not a or not b:
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
