"""CPU: `ember bench vllm --tp N --pins-cost` alternates vLLM's default configuration of the shape
and a pod's pinned one, and a decode step is measured with the prefill cancelled."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ember_bench import vllm_child, vllm_parallel, vllm_pins


def test_default_and_pinned_runs_alternate_and_each_batchs_step_is_compared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[tuple[str, bool, bool, str | None, bool]] = []
    real_env = vllm_parallel.child_env
    monkeypatch.delenv("VLLM_ALLREDUCE_USE_SYMM_MEM", raising=False)

    def engine(mode: str, args: list[str], work: Path, extra: dict, *a, name: str = "", pinned: bool = True,
               **kw) -> dict:
        # symmetric-memory all-reduce (NVLink multicast) is off in both: the machines forbid multicast
        symm = real_env("native", args, work, extra, pinned).get("VLLM_ALLREDUCE_USE_SYMM_MEM")
        compiled = json.loads(args[args.index("--compilation-config") + 1])
        deterministic = compiled.get("inductor_compile_config", {}).get("deterministic", False)
        got.append((name, pinned, "--disable-custom-all-reduce" in args, symm, deterministic))
        if name == "pinned-2":
            return {"rc": 1}  # a failed run: its figures are missing, not zero
        step = {"default": 2.0, "pinned": 2.2}[name.split("-")[0]]
        return {"rc": 0, "decode_step_ms": {"1": step, "16": step * 2}}

    monkeypatch.setattr(vllm_parallel, "run_engine", engine)
    monkeypatch.setattr("ember_bench.vllm_report._device", lambda: "gpu")
    out = vllm_pins.bench_pins_cost("llama-3-8b", 2, 2, False, 1, work=tmp_path, out_dir=tmp_path / "out",
                                    batch_sizes=[1, 16], steps=32, gpu_memory_utilization=0.4, timeout=9)
    assert got == [(f"{how}-{r}", how == "pinned", how == "pinned", "0", how == "pinned")
                   for r in range(1, vllm_pins.ROUNDS + 1) for how in ("default", "pinned")]
    summary = json.loads(out.read_text())["summary"]
    assert out.name == "vllm-pins-gpu-llama-3-8b-tp2.json" and summary["failed_runs"] == ["pinned-2"]
    rest = vllm_pins.ROUNDS - 2
    assert summary["decode_step"]["1"] == {"default_ms": [2.0] * vllm_pins.ROUNDS,
                                           "pinned_ms": [2.2, None, *[2.2] * rest],
                                           "pinned_over_default": None,
                                           "round_ratios": [1.1, None, *[1.1] * rest]}


def test_the_ratio_is_the_pinned_mean_over_the_default_mean_and_each_rounds_own_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_pins, "ROUNDS", 2)
    runs = {"default-1": {"decode_step_ms": {"8": 2.0}}, "default-2": {"decode_step_ms": {"8": 2.0}},
            "pinned-1": {"decode_step_ms": {"8": 1.8}}, "pinned-2": {"decode_step_ms": {"8": 2.6}}}
    step = vllm_pins.summarize_pins(runs, [8])["decode_step"]["8"]
    assert step["pinned_over_default"] == 1.1 and step["round_ratios"] == [0.9, 1.3]  # rounds disagree


class _Timed:
    """An async engine stand-in on a fake clock: a batch's n tokens take 30 ms of prefill and
    n x 2 ms (the first token's step included)."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    async def pause_generation(self, mode: str, clear_cache: bool) -> None: ...

    async def resume_generation(self) -> None: ...

    async def add_request(self, rid: str, prompt: dict, n: int, data_parallel_rank: int | None = None
                          ) -> asyncio.Queue:
        self.clock[0] += (0.030 + n * 0.002) / 4  # four requests per batch, in parallel
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(SimpleNamespace(finished=True, outputs=[SimpleNamespace(token_ids=[1] * n)]))
        return q


def test_a_decode_step_is_the_time_to_n_tokens_less_the_time_to_one_over_n_minus_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(vllm_child.time, "perf_counter", lambda: clock[0])
    ms = asyncio.run(vllm_child.decode_step_ms(_Timed(clock), 4, 17, params=lambda n: n))
    assert ms == pytest.approx(2.0)  # the 30 ms prefill cancelled


def test_one_gpu_measures_the_deterministic_mode_alone(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`--pins-cost` without a parallel flag: the one-GPU shape, whose pods differ from vLLM's
    default only by Inductor's deterministic mode."""
    from ember_bench import vllm as bench

    seen: list[tuple[int, int, int, object]] = []
    monkeypatch.setattr(vllm_parallel, "bench_shape",
                        lambda model, layers, tp, ep, dp, **kw: seen.append((tp, ep, dp, kw.get("run"))))
    bench.bench_vllm(model="llama-3-8b", layers=2, work=tmp_path, out_dir=tmp_path, pins_cost=True)
    assert seen == [(1, 1, 1, vllm_pins.bench_pins_cost)]
    from ember.engines.vllm.args import engine_args

    ident = vllm_parallel.shape_identity(tmp_path / "cfg", 1, False, 1)
    default, pinned = engine_args(ident, rank_pins=False, deterministic=False), engine_args(ident)
    differ = [(a, b) for a, b in zip(default, pinned, strict=True) if a != b]
    assert len(differ) == 1 and '"deterministic": true' in differ[0][1]
