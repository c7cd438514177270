"""Where one slow graph's GPU time goes: a replay under torch.profiler, its kernels by time.

SAVE's proof names its slowest graphs (`ProofReport.slowest`); when one takes seconds (a vLLM V2
SAVE replayed 20 small graphs for minutes, benchmarks/results/h200-20261129d) the kernel that
spends them is what to look at next, and a GPU session is too scarce to go back for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def top_kernels(replay: Callable[[], None], n: int = 8) -> list[str]:
    """`replay()` once under the profiler; its `n` costliest kernels as 'name: ms (calls)'. Never
    raises: a profiler that cannot run says why instead."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            replay()
            torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            us = float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0))
            if us > 0:
                rows.append((us, e.key, int(e.count)))
        rows.sort(reverse=True)
        return [f"{name[:100]}: {us / 1e3:.3f} ms ({count})" for us, name, count in rows[:n]]
    except Exception as exc:  # a diagnosis, never a reason for SAVE to fail
        return [f"the profiler could not run: {type(exc).__name__}: {exc}"]
