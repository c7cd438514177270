"""The plan of `ember bench vllm-switch` (no GPU, no vLLM): the two shapes, which GPUs each engine
gets, why a machine cannot run it, and the trickle's figures per time window.

The old shape serves on the first GPUs of the machine; the new shape comes up on the first GPUs
of its own size, so it shares the old shape's GPUs while both run (what a switch in place on one
node does: the old pods keep serving until the new ones are ready). Both engines are given a
fixed fraction of each GPU's memory (vLLM's `--gpu-memory-utilization`), and vLLM refuses to start
when the GPU's free memory is below that fraction of its total (v1/worker/utils.py
`request_memory`), so the two fractions must fit together on a shared GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# CUDA contexts, NCCL buffers and vLLM's non-torch memory of two engines on one GPU: what the two
# fractions leave free. Measured nowhere yet; a guess on the safe side (2 x ~1-3 GiB of 141 GiB).
SHARED_GPU_HEADROOM = 0.1


@dataclass(frozen=True)
class Shape:
    """A vLLM parallel shape as `ember bench vllm` names it: tensor x data ranks, experts spread
    over all of them (EP = tensor x data) or not."""

    tensor: int = 1
    data: int = 1
    expert: bool = False

    @property
    def world(self) -> int:
        return self.tensor * self.data

    @property
    def name(self) -> str:
        """`ember bench vllm --tp/--ep`'s name of the shape ("ep2-dp2": EP 2 over 2 DP ranks)."""
        from ember_bench.vllm_parallel import shape_name

        return shape_name(self.tensor, self.expert, self.data)


def shape(tp: int, ep: int) -> Shape:
    """`--tp`/`--ep` as a shape: EP N spans tensor x data = N ranks (data = N / tensor: attention
    data parallel, vLLM's expert-parallel layout); EP 1 is tensor parallel alone."""
    if tp < 1 or ep < 1:
        raise ValueError(f"tensor {tp} and expert {ep} must be at least 1")
    if ep == 1:
        return Shape(tensor=tp)
    if ep % tp:
        raise ValueError(f"expert parallel {ep} must be a multiple of tensor parallel {tp}")
    return Shape(tensor=tp, data=ep // tp, expert=True)


@dataclass(frozen=True)
class Plan:
    old: Shape
    new: Shape
    gpus: tuple[str, ...]  # the machine's GPUs (CUDA_VISIBLE_DEVICES' names, else indices)
    old_gpus: tuple[str, ...]
    new_gpus: tuple[str, ...]
    save_gpu: str
    memory_fraction: float
    refusals: tuple[str, ...] = ()

    @property
    def shared_gpus(self) -> tuple[str, ...]:
        """GPUs that hold both engines during the switch."""
        return tuple(g for g in self.new_gpus if g in self.old_gpus)

    def as_dict(self) -> dict[str, Any]:
        return {"old": self.old.name, "new": self.new.name, "gpus": list(self.gpus),
                "old_gpus": list(self.old_gpus), "new_gpus": list(self.new_gpus),
                "shared_gpus": list(self.shared_gpus), "save_gpu": self.save_gpu,
                "memory_fraction": self.memory_fraction, "refusals": list(self.refusals)}


def plan(old: Shape, new: Shape, gpus: list[str], memory_fraction: float) -> Plan:
    """Which GPUs each engine and each SAVE gets; `refusals` says why this machine cannot run it."""
    why = []
    if old == new:
        why.append(f"the old and the new shape are the same ({old.name}): nothing switches")
    for label, s in (("old", old), ("new", new)):
        if len(gpus) < s.world:
            why.append(f"the {label} shape {s.name} needs {s.world} GPUs, this machine has {len(gpus)}"
                       f" ({', '.join(gpus) or 'none visible'})")
    if not 0 < memory_fraction < 1:
        why.append(f"memory fraction {memory_fraction} is not in (0, 1)")
    elif 2 * memory_fraction > 1 - SHARED_GPU_HEADROOM:
        why.append(f"two engines of {memory_fraction:.2f} of a GPU each do not fit on one GPU with "
                   f"{SHARED_GPU_HEADROOM:.2f} left for their contexts (vLLM refuses to start when "
                   "free memory is below its fraction): use at most "
                   f"{(1 - SHARED_GPU_HEADROOM) / 2:.2f}")
    return Plan(old=old, new=new, gpus=tuple(gpus), old_gpus=tuple(gpus[: old.world]),
                new_gpus=tuple(gpus[: new.world]), save_gpu=gpus[0] if gpus else "",
                memory_fraction=memory_fraction, refusals=tuple(why))


def variants_problem(chosen: tuple[str, ...], known: tuple[str, ...]) -> str:
    """What is wrong with the new shape's starts ("" when nothing): known names, each once, and
    native-warm after native (it starts on the vLLM cache native filled)."""
    if not chosen or any(v not in known for v in chosen) or len(set(chosen)) != len(chosen):
        return f"each of {', '.join(known)} at most once"
    if "native-warm" in chosen and ("native" not in chosen
                                    or chosen.index("native") > chosen.index("native-warm")):
        return "native-warm starts on the vLLM cache native left: native before it"
    return ""


def visible_gpus(env_value: str | None, count: int) -> list[str]:
    """The machine's GPUs as the children name them in CUDA_VISIBLE_DEVICES: the parent's own list
    when it has one (indices or UUIDs), else 0..count-1."""
    if env_value is not None and env_value.strip():
        return [g.strip() for g in env_value.split(",") if g.strip()]
    if env_value is not None:  # set but empty: CUDA sees no GPU
        return []
    return [str(i) for i in range(count)]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def window(requests: list[dict[str, Any]], start: float, end: float | None) -> dict[str, Any]:
    """The trickle's requests SENT in [start, end) (monotonic seconds; end None: until the last):
    how many were served and failed, and the served ones' latency (send → last token)."""
    sent = [r for r in requests if r["sent"] >= start and (end is None or r["sent"] < end)]
    ok = [r["done"] - r["sent"] for r in sent if r.get("ok")]
    return {
        "seconds": None if end is None else round(end - start, 3),
        "sent": len(sent),
        "served": len(ok),
        "failed": len(sent) - len(ok),
        "errors": sorted({str(r.get("error")) for r in sent if not r.get("ok")})[:5],
        "latency_p50_s": _round(percentile(ok, 50)),
        "latency_p99_s": _round(percentile(ok, 99)),
        "latency_max_s": _round(max(ok) if ok else None),
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)
