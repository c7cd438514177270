"""Per-kernel timings of decode steps (CUPTI through torch.profiler), to find where two processes'
steps differ: a kernel that runs longer, or the gaps between kernels.

The bench's native and LOAD children call `maybe_profile` after their TPOT when
EMBER_PROFILE_KERNELS names a directory; each writes `<role>.json` there. `compare` lines up two
such files (same graph, same kernel order) and says where the time went:

    python benchmarks/ember_bench/kernel_profile.py native.json load.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

STEPS = 5


Launch = Callable[[tuple[int, ...]], None]


def profile_steps(launch: Launch, batch: int, steps: int = STEPS) -> dict[str, Any]:
    """Kernels of `steps` launches of the batch's graph: [name, start us, duration us] each, in
    start order, and how many kernels one step has."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    launch((batch,))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            launch((batch,))
            torch.cuda.synchronize()  # steps apart, so each is one span
    kernels = sorted(
        (
            (e.name, e.time_range.start, e.time_range.end - e.time_range.start)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ),
        key=lambda k: k[1],
    )
    per = len(kernels) // steps
    return {"kernels": kernels, "per_step": per}


def maybe_profile(role: str, launch: Launch, batches: list[int]) -> None:
    """Writes `<EMBER_PROFILE_KERNELS>/<role>.json` (per batch) when that variable is set."""
    out = os.environ.get("EMBER_PROFILE_KERNELS")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {str(b): profile_steps(launch, b) for b in batches}
    if os.environ.get("EMBER_MODE"):  # under libember: how its heap is mapped
        from ember.native import Interposer

        st = Interposer.attach().stats()
        res["region"] = {k: st.get(k) for k in ("map_calls", "bytes_mapped")}
    Path(out, f"{role}.json").write_text(json.dumps(res))


def _summary(step: list[Any]) -> dict[str, float]:
    busy = sum(k[2] for k in step)
    span = step[-1][1] + step[-1][2] - step[0][1]
    return {"span_us": span, "busy_us": busy, "gaps_us": span - busy, "kernels": len(step)}


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per batch: each side's median step (span, summed kernel time, summed gaps), and the kernel
    names whose summed duration differs most between the two."""
    out: dict[str, Any] = {}
    for batch in (k for k in a if k != "region"):
        sides = []
        for prof in (a[batch], b[batch]):
            per, ks = prof["per_step"], prof["kernels"]
            steps = [ks[i * per : (i + 1) * per] for i in range(len(ks) // per)]
            sums = [_summary(s) for s in steps]
            by_name: dict[str, list[float]] = defaultdict(list)
            for s in steps:
                for name, _, dur in s:
                    by_name[name].append(dur)
            sides.append(
                (
                    {k: statistics.median(x[k] for x in sums) for k in sums[0]},
                    {n: sum(v) / len(steps) for n, v in by_name.items()},
                )
            )
        (sa, na), (sb, nb) = sides
        diff = sorted(((nb.get(n, 0.0) - na.get(n, 0.0), n) for n in set(na) | set(nb)), key=lambda x: x[0])
        out[batch] = {"a": sa, "b": sb, "most_faster_in_b": diff[:8], "most_slower_in_b": diff[-4:]}
    return out


if __name__ == "__main__":
    print(json.dumps(compare(*(json.loads(Path(p).read_text()) for p in sys.argv[1:3])), indent=1))
