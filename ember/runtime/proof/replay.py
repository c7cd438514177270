"""Replay measurements shared by SAVE, LOAD, `ember verify --replay` and the benchmark: output
fingerprints over all keys in a fixed order, greedy decode token histories, and TPOT.

`fingerprint` is engine-agnostic (a pure tensor hash). The others replay a DECODE workload: keys
are `(batch,)`, one replay is one decode step, and the workload keeps the tokens it decoded in a
`[steps + 1, batch]` history (`DecodeReplay`; ember's built-in decode workload,
`ember.engines.decode.model.DecodeWorkload`, is the one that has it). They live here, next to
the proof, because they are what a restored graph is measured with in every process.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ember.runtime.proof.measures import step_hashes

GraphKey = tuple[int, ...]


class DecodeReplay(Protocol):
    """A decode workload as the replay measurements drive it."""

    @property
    def history(self) -> torch.Tensor:
        """Tokens decoded so far, one row per step ([steps + 1, max batch]; all steps' worth)."""
        ...

    def reset_state(self, seed: int | None = None) -> None:
        """Everything a decode run reads back to one state (seeded input ids)."""
        ...


def fingerprint(tensors: list[torch.Tensor]) -> list[int]:
    """An exact, order-sensitive integer fingerprint of tensors' bytes, computed on the GPU (one
    host sync for all of them)."""
    return [int(x) for x in fingerprints_on_device(tensors).tolist()] if tensors else []


def fingerprints_on_device(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`fingerprint`'s numbers as an int64 tensor on the tensors' device, without waiting for them:
    a step can queue one per graph it launches and read them all at its end."""
    out = []
    for t in tensors:
        b = t.contiguous().view(torch.uint8).view(-1)
        if b.data_ptr() % 8:  # a view at an odd offset (a slice of a fused buffer) is read as words
            b = b.clone()
        n = b.numel() - b.numel() % 8
        w = b[:n].view(torch.int64)
        weights = torch.arange(1, w.numel() + 1, device=w.device, dtype=torch.int64) * 2654435761
        tail = b[n:].to(torch.int64).sum()  # 0 where there is no tail
        out.append((w * weights).sum() ^ w.sum() ^ tail)
    return torch.stack(out)


def warm_fingerprints(device: torch.device | int | str) -> float:
    """Launch each kernel `fingerprints_on_device` uses once, on a few bytes, and wait: a kernel's
    first launch in a process loads it (CUDA's lazy module loading), tens of milliseconds that would
    otherwise land in the first step a canary fingerprints. Returns the milliseconds it took."""
    t0 = time.perf_counter()
    raw = torch.zeros(4112, dtype=torch.uint8, device=device)
    # whole words, aligned for the widest vector loads and for words only (elementwise kernels
    # come in one variant per alignment); an odd offset with a tail (the clone, the tail's sum)
    fingerprints_on_device([raw[:4096].view(torch.bfloat16), raw[8:4104], raw[1:14]])
    if raw.is_cuda:
        torch.cuda.synchronize(raw.device)
    return (time.perf_counter() - t0) * 1e3


def _all_steps(workload: DecodeReplay) -> int:
    """The steps a decode run takes by default: as many as the history holds (its first row is
    the start)."""
    return int(workload.history.shape[0]) - 1


def replay_fingerprints(
    workload: DecodeReplay,
    launch: Callable[[GraphKey], None],
    keys: list[GraphKey],
    outputs: Callable[[GraphKey], list[torch.Tensor]],
    seed: int = 7,
) -> dict[str, list[int]]:
    """Reset the state, replay every key once in order, fingerprint each graph's outputs."""
    workload.reset_state(seed)
    out = {}
    for key in keys:
        launch(key)
        torch.cuda.synchronize()
        out[",".join(map(str, key))] = fingerprint(outputs(key))
    return out


def decode_tokens(
    workload: DecodeReplay,
    launch: Callable[[GraphKey], None],
    batch: int,
    steps: int | None = None,
    seed: int = 11,
) -> tuple[str, list[int]]:
    """Greedy decode by replay alone (`steps`: default all the history holds); returns sha256 of
    the token history and its first row."""
    steps = _all_steps(workload) if steps is None else steps
    workload.reset_state(seed)
    for _ in range(steps):
        launch((batch,))
    torch.cuda.synchronize()
    hist = workload.history[:steps, :batch].cpu()
    return hashlib.sha256(hist.numpy().tobytes()).hexdigest(), hist[:, 0].tolist()[:16]


def decode_trace(
    workload: DecodeReplay,
    launch: Callable[[GraphKey], None],
    batch: int,
    steps: int | None = None,
    seed: int = 11,
) -> dict[str, Any]:
    """decode_tokens plus per-step hashes: {"sha256", "steps"} (what SAVE/LOAD/bench compare)."""
    steps = _all_steps(workload) if steps is None else steps
    sha, _ = decode_tokens(workload, launch, batch, steps, seed)
    return {"sha256": sha, "steps": step_hashes(workload.history[:steps, :batch].cpu().numpy())}


def tpot_ms(
    workload: DecodeReplay,
    launch: Callable[[GraphKey], None],
    batch: int,
    steps: int = 64,
    repeat: int = 3,
) -> float:
    """Mean milliseconds per decode step (graph replay), best of `repeat` runs."""
    best = float("inf")
    for _ in range(repeat):
        workload.reset_state()
        launch((batch,))  # a switch, if any, is not part of the token time
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            launch((batch,))
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / steps)
    return best
