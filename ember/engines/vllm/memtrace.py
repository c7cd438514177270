"""A diagnostic for a LOAD that diverges from SAVE's allocations: torch's allocation history of a
vLLM worker, with each allocation's Python stack, written where a SAVE's and a LOAD's can be put
side by side (libember names only the first differing event: its size and address).

On with `EMBER_VLLM_MEMORY_TRACE=DIR` (off by default: recording stacks slows every allocation).
Recording starts where the worker sets up its distributed environment (after its device is
chosen, before NCCL's and the process groups' buffers), so what stays live in torch's pool when
libember arms is in it too. `dump` writes `DIR/<mode>-rank<r>-<tag>.json`: the segments held then,
and the trace's entries (segment allocations and frees, allocations), oldest first.
"""

from __future__ import annotations

import json
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
    out = where / f"{mode or 'native'}-rank{rank}-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summarize(torch.cuda.memory._snapshot(), device), default=str))
    return out
