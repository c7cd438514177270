"""`ember bench vllm [--tp N | --ep | --dp N] --pins-cost`: what ember's pins cost per decode step.

Every vLLM archive is compiled, and its pods run, with Inductor's deterministic mode
(`args.NUMERICS`: reductions compiled by rule, not by timing); a parallel one also with the vLLM
features that keep per-rank peer state turned off (`args.engine_args`'s rank pins,
`ranks.PARALLEL_ENV`): custom all-reduce, symmetric-memory and FlashInfer all-reduce, the
all-reduce fusion passes and sequence parallelism, and EP's all2all pinned to all-gather +
reduce-scatter (docs/multi-gpu.md). Without --tp/--ep/--dp the shape is one GPU and only the
deterministic mode differs. This bench measures what that costs a serving pod: native N-rank
vLLM as vLLM runs the shape by default (`default`) and as a pod runs it (`pinned`), alternated
over four rounds (each configuration's first start compiles, the later ones find its compile
cache); each round's own ratio is in the summary, so a difference smaller than the noise between
rounds shows as such. Each run times one decode step at several batch sizes
(`vllm_child.decode_step_ms`). No SAVE, no LOAD: no ember code is in the engine. Report:
`benchmarks/results/vllm-pins-<device>-<model>-<shape>.json`.

One exception to "default": symmetric-memory all-reduce stays off in both (`DEFAULT_ENV`). Its
multimem operations need NVLink multicast, which the GPU machines keep off: a program using it
can put a shared host's GPUs out of service. The cost measured is therefore the deterministic
mode, custom all-reduce, the fusion passes and sequence parallelism (and the all2all pin with EP).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

ROUNDS = 4  # two rounds at 8 layers disagreed in sign (h200x2-20261130c)
DEFAULT_ENV = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}  # see the module doc


def bench_pins_cost(model: str, layers: int, tensor: int, expert: bool, data: int, *, work: Path,
                    out_dir: Path, batch_sizes: list[int], steps: int, gpu_memory_utilization: float,
                    timeout: float) -> Path:
    """default and pinned native N-rank vLLM, alternated ROUNDS times; the report's path."""
    from ember.engines.vllm.args import engine_args
    from ember_bench.vllm import write_config
    from ember_bench.vllm_parallel import extra_args, run_engine, shape_identity, shape_name
    from ember_bench.vllm_report import _device

    name = shape_name(tensor, expert, data)
    work = work.absolute() / f"{model}-{layers or 'all'}l-{name}-pins"
    ident = shape_identity(write_config(model, layers or None, work / "config"), tensor, expert, data)
    extra = extra_args(gpu_memory_utilization)
    vllms_own = engine_args(ident, rank_pins=False, deterministic=False)
    configs = {"default": ([*vllms_own, *extra], False, DEFAULT_ENV),
               "pinned": ([*engine_args(ident), *extra], True, {})}
    steps = max(2, steps)
    options = {"batch_sizes": [1], "max_tokens": 1, "decode_batches": batch_sizes, "decode_steps": steps}
    runs = {f"{how}-{r}": run_engine("native", args, work, env, options, timeout, name=f"{how}-{r}",
                                     pinned=pinned)
            for r in range(1, ROUNDS + 1) for how, (args, pinned, env) in configs.items()}
    summary = {"shape": name, "model": model, "layers": layers, "decode_steps": steps,
               **summarize_pins(runs, batch_sizes)}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"vllm-pins-{_device()}-{model}-{name}.json"
    path.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1, default=str))
    typer.echo(json.dumps(summary, indent=1, default=str))
    return path


def summarize_pins(runs: dict[str, dict[str, Any]], batch_sizes: list[int]) -> dict[str, Any]:
    """Per batch size: each configuration's decode step (ms) in every round, the pinned one's mean
    over the default's (`pinned_over_default`: 1.05 is 5 % slower; None where a run failed) and
    each round's pinned over default (`round_ratios`)."""
    per_batch: dict[str, Any] = {}
    for b in map(str, batch_sizes):
        ms = {how: [(runs.get(f"{how}-{r}") or {}).get("decode_step_ms", {}).get(b)
                    for r in range(1, ROUNDS + 1)] for how in ("default", "pinned")}
        whole = all(v is not None for v in ms["default"] + ms["pinned"])
        ratio = sum(ms["pinned"]) / sum(ms["default"]) if whole and sum(ms["default"]) else None
        pairs = zip(ms["pinned"], ms["default"], strict=True)
        rounds = [round(p / d, 3) if p is not None and d else None for p, d in pairs]
        per_batch[b] = {**{f"{how}_ms": v for how, v in ms.items()},
                        "pinned_over_default": round(ratio, 3) if ratio is not None else None,
                        "round_ratios": rounds}
    return {"decode_step": per_batch, "failed_runs": sorted(k for k, v in runs.items() if v.get("rc"))}
