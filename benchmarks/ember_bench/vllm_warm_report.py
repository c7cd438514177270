"""The report of `ember bench vllm-warm`: per run (cold-native, cold-native-warm-cache,
cold-restored, warm-ready, warm-sleeping) its figures, the goal verdicts, JSON and a Markdown table
(what every warm-pod bench shares: ember_bench.warm_report). Pure: the unit tests feed it results
by hand."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ember_bench import warm_report
from ember_bench.pods import parse_smi
from ember_bench.warm_report import goal, no_error

__all__ = ["RUNS", "earlier", "markdown", "parse_smi", "summarize", "verdicts", "write_report"]

BENCH = "vllm-warm"
# cold-native-warm-cache: a native start on the vLLM cache cold-native left, as on a node that ran
# the model before (vLLM's own answer to a slow start), so it runs after cold-native.
RUNS = ("cold-native", "cold-native-warm-cache", "cold-restored", "warm-ready", "warm-sleeping")
READY_GOAL_S = 0.3  # issue 37: claim → first token of a warm pod whose engine is ready
SLEEPING_GOAL_S = 1.0  # ... and of one whose engine sleeps (the lighter mode is worth it only then)
COLD_GOAL = 0.5  # a cold restored pod: start → first token ≤ this × vLLM's own warm-cache start


def verdicts(rows: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """The goals (None: not measured). A warm pod that captured natively does not meet them."""
    ready, sleeping = rows.get("warm-ready") or {}, rows.get("warm-sleeping") or {}
    # the pod's own processes where nvidia-smi lists them (blind to other GPU users), else the GPU's rise
    key = "gpu_idle_pod_mib" if ready.get("gpu_idle_pod_mib") and sleeping.get("gpu_idle_pod_mib") \
        else "gpu_idle_held_mib"
    idle_r, idle_s = ready.get(key), sleeping.get(key)
    woken = sleeping.get("tokens_equal_reference")
    restored = (rows.get("cold-restored") or {}).get("claim_to_first_token_s")
    own_cache = (rows.get("cold-native-warm-cache") or {}).get("claim_to_first_token_s")
    return {
        f"warm ready: claim → first token ≤ {READY_GOAL_S} s (restored)": goal(
            ready.get("claim_to_first_token_s"), READY_GOAL_S, ready.get("restored")),
        f"warm sleeping: claim → first token ≤ {SLEEPING_GOAL_S} s (restored)": goal(
            sleeping.get("claim_to_first_token_s"), SLEEPING_GOAL_S, sleeping.get("restored")),
        "warm sleeping holds less GPU memory idle than warm ready": None if idle_r is None or idle_s is None
        else idle_s < idle_r,
        "tokens after the wake-up equal the reference run's": woken,
        f"cold restored: start → first token ≤ {COLD_GOAL} × vLLM's own warm cache": None
        if restored is None or own_cache is None
        else bool((rows.get("cold-restored") or {}).get("restored")) and restored <= COLD_GOAL * own_cache,
        "every run without an error": no_error(rows),
    }


def summarize(results: dict[str, dict[str, Any]], saves: dict[str, dict[str, Any]],
              gpu: dict[str, Any]) -> dict[str, Any]:
    return warm_report.summarize(results, saves, gpu, verdicts)


def markdown(model: str, summary: dict[str, Any]) -> str:
    gpu = summary.get("gpu") or {}
    lines = [
        f"# vLLM warm pods, {model}, {gpu.get('name', 'unknown GPU')}",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `ember bench vllm-warm`: `ember serve --engine vllm` "
        "behind a hand-off written as the sidecar writes it; random weights; each run a fresh process "
        "with an empty vLLM cache (cold-native-warm-cache: the one cold-native left). GPU memory by "
        f"nvidia-smi (total {gpu.get('total_mib', '?')} MiB). "
        f"Greedy tokens compared with {summary.get('tokens_reference') or 'no run'}'s.",
        "",
        *warm_report.tables(summary, RUNS),
    ]
    return "\n".join(lines) + "\n"


def earlier(model: str, gpu: dict[str, Any], out_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results, saves) of an earlier invocation's report on this GPU and model, to go on from."""
    return warm_report.earlier(BENCH, model, gpu, out_dir)


def write_report(model: str, results: dict[str, dict[str, Any]], saves: dict[str, dict[str, Any]],
                 gpu: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    summary = summarize(results, saves, gpu)
    return warm_report.write(BENCH, model, results, saves, summary, markdown(model, summary), out_dir)
