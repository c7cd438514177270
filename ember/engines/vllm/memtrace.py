"""A diagnostic for a LOAD that diverges from SAVE's allocations: torch's allocation history of a
vLLM worker, with each allocation's Python stack, written where a SAVE's and a LOAD's can be put
side by side (libember names only the first differing event: its size and address).

On with `EMBER_VLLM_MEMORY_TRACE=DIR` (off by default: recording stacks slows every allocation).
Recording starts where the worker sets up its distributed environment (after its device is
chosen, before NCCL's and the process groups' buffers), so what stays live in torch's pool when
libember arms is in it too. `dump` writes `DIR/<mode>-rank<r>-<pid>-<tag>.json`: the segments
held then, and the trace's entries (segment allocations and frees, allocations), oldest first.
The plugin dumps after each start-up stage of the worker and where LOAD refuses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ember import settings

ENV = "EMBER_VLLM_MEMORY_TRACE"
MAX_ENTRIES = 20000
ACTIONS = ("segment_alloc", "segment_map", "segment_free", "segment_unmap", "alloc")


def folder() -> Path | None:
    raw = settings.text(ENV)
    return Path(raw) if raw else None


def start() -> None:  # pragma: no cover - needs CUDA
    """Record torch's allocation history from now on, with Python stacks."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")


def frames(raw: list[dict[str, Any]] | None, keep: int = 8) -> list[str]:
    """The innermost `keep` frames outside torch's own modules, as "file:line name"."""
    out = []
    for f in raw or []:
        name = str(f.get("filename", ""))
        if ("/torch/" in name and "/_inductor/" not in name) or name.startswith("??"):
            continue
        out.append(f"{name.split('site-packages/')[-1]}:{f.get('line')} {f.get('name')}")
        if len(out) == keep:
            break
    return out


def summarize(snapshot: dict[str, Any], device: int) -> dict[str, Any]:
    """A torch memory snapshot cut to what comparing two processes needs."""
    segments = [
        {"address": s.get("address"), "size": s.get("total_size"), "pool": s.get("segment_type"),
         "live": [{"size": b.get("requested_size", b.get("size")), "frames": frames(b.get("frames"))}
                  for b in s.get("blocks") or [] if b.get("state") == "active_allocated"]}
        for s in snapshot.get("segments") or [] if s.get("device") == device
    ]
    traces = snapshot.get("device_traces") or []
    entries = [
        {"i": i, "action": e.get("action"), "size": e.get("size"), "addr": e.get("addr"),
         "frames": frames(e.get("frames"))}
        for i, e in enumerate(traces[device] if device < len(traces) else [])
        if e.get("action") in ACTIONS
    ]
    return {"segments": segments, "trace": entries}


def dump(mode: str, rank: int, tag: str) -> Path | None:  # pragma: no cover - needs CUDA
    """This process's history so far (see the module docstring); None when tracing is off."""
    where = folder()
    if where is None:
        return None
    import torch

    device = torch.cuda.current_device()
    out = where / f"{mode or 'native'}-rank{rank}-{os.getpid()}-{tag}.json"  # one file per process
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summarize(torch.cuda.memory._snapshot(), device), default=str))
    return out


def segments(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace's segment allocations in order: what libember counts as allocation events."""
    return [e for e in trace if e.get("action") in ("segment_alloc", "segment_map")]


def compare(saved: dict[str, Any], loaded: dict[str, Any], context: int = 3) -> list[str]:
    """Two dumps' segment allocations side by side up to the first that differs in size, with
    what allocated each around it (SAVE left, LOAD right); [] when one is a prefix of the other."""
    a, b = segments(saved.get("trace") or []), segments(loaded.get("trace") or [])
    pairs = enumerate(zip(a, b, strict=False))  # dumps taken at different points: a prefix is fine
    first = next((i for i, (x, y) in pairs if x.get("size") != y.get("size")), None)
    if first is None:
        return []
    out = [f"segment allocation #{first} differs: SAVE {a[first].get('size')} B, "
           f"LOAD {b[first].get('size')} B"]
    for i in range(max(0, first - context), min(max(len(a), len(b)), first + context + 1)):
        for side, seq in (("SAVE", a), ("LOAD", b)):
            if i < len(seq):
                where = (seq[i].get("frames") or ["?"])[0]
                out.append(f"{'>' if i == first else ' '} #{i} {side} {seq[i].get('size'):>12} {where}")
    return out


if __name__ == "__main__":  # pragma: no cover - a diagnostic's command line
    import sys

    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m ember.engines.vllm.memtrace SAVE.json LOAD.json")
    lines = compare(*(json.loads(Path(p).read_text()) for p in sys.argv[1:3]))
    print("\n".join(lines) if lines else "the same segment allocations (one a prefix of the other)")
