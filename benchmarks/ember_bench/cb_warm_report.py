"""The report of `ember bench cb-warm`: per run (cold-native, cold-restored, warm-ready) its
figures, the goal verdicts, JSON and a Markdown table (what every warm-pod bench shares:
ember_bench.warm_report). Pure: the unit tests feed it results by hand."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ember_bench import warm_report
from ember_bench.warm_report import goal, no_error

BENCH = "cb-warm"
RUNS = ("cold-native", "cold-restored", "warm-ready")  # transformers has no sleeping engine
READY_GOAL_S = 0.3  # issue 37: claim → first token of a warm pod whose engine is ready


def cold_ratio(rows: dict[str, dict[str, Any]]) -> float | None:
    """Cold restored start → first token over cold native's (None unless both measured)."""
    restored = (rows.get("cold-restored") or {}).get("claim_to_first_token_s")
    native = (rows.get("cold-native") or {}).get("claim_to_first_token_s")
    return None if restored is None or not native else round(restored / native, 3)


def verdicts(rows: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """The goals (None: not measured). A pod that captured natively does not meet the warm or
    the cold one."""
    ready, restored = rows.get("warm-ready") or {}, rows.get("cold-restored") or {}
    ratio = cold_ratio(rows)
    equal = [r.get("tokens_equal_reference") for r in (ready, restored)]
    return {
        f"warm ready: claim → first token ≤ {READY_GOAL_S} s (restored)": goal(
            ready.get("claim_to_first_token_s"), READY_GOAL_S, ready.get("restored")),
        "greedy tokens of warm-ready and cold-restored equal the reference run's": None
        if None in equal else all(equal),
        "cold restored: start → first token shorter than cold native's (restored)": None
        if ratio is None else bool(restored.get("restored")) and ratio < 1.0,
        "every run without an error": no_error(rows),
    }


def summarize(results: dict[str, dict[str, Any]], saves: dict[str, dict[str, Any]],
              gpu: dict[str, Any]) -> dict[str, Any]:
    summary = warm_report.summarize(results, saves, gpu, verdicts)
    summary["cold_restored_over_native"] = cold_ratio(summary["runs"])
    return summary


def markdown(model: str, summary: dict[str, Any]) -> str:
    gpu = summary.get("gpu") or {}
    lines = [
        f"# transformers continuous-batching warm pods, {model}, {gpu.get('name', 'unknown GPU')}",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `ember bench cb-warm`: `ember serve` (transformers "
        "continuous batching) behind a hand-off written as the sidecar writes it; random weights; each "
        f"run a fresh process. GPU memory by nvidia-smi (total {gpu.get('total_mib', '?')} MiB). "
        f"Greedy tokens compared with {summary.get('tokens_reference') or 'no run'}'s. Cold start → "
        f"first token, restored over native: {warm_report.fmt(summary.get('cold_restored_over_native'))}.",
        "",
        *warm_report.tables(summary, RUNS),
    ]
    return "\n".join(lines) + "\n"


def write_report(model: str, results: dict[str, dict[str, Any]], saves: dict[str, dict[str, Any]],
                 gpu: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    summary = summarize(results, saves, gpu)
    return warm_report.write(BENCH, model, results, saves, summary, markdown(model, summary), out_dir)
