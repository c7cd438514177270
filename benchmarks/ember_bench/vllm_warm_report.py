"""The report of `ember bench vllm-warm`: per run (cold-native, cold-native-warm-cache,
cold-restored, warm-ready, warm-sleeping) its figures, the goal verdicts, JSON and a Markdown
table. Pure: the unit tests feed it results by hand."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

# cold-native-warm-cache: a native start on the vLLM cache cold-native left, as on a node that ran
# the model before (vLLM's own answer to a slow start), so it runs after cold-native.
RUNS = ("cold-native", "cold-native-warm-cache", "cold-restored", "warm-ready", "warm-sleeping")
READY_GOAL_S = 0.3  # issue 37: claim → first token of a warm pod whose engine is ready
SLEEPING_GOAL_S = 1.0  # ... and of one whose engine sleeps (the lighter mode is worth it only then)
COLD_GOAL = 0.5  # a cold restored pod: start → first token ≤ this × vLLM's own warm-cache start

# Row name → (result key, unit), in the order of the Markdown table.
ROWS: dict[str, tuple[str, str]] = {
    "claim → first token (client)": ("claim_to_first_token_s", "s"),
    "claim → ready (ember serve's report)": ("claim_to_ready_s", "s"),
    "process start → ready (cold) / engine ready (warm)": ("start_to_ready_s", "s"),
    "first-token requests refused before one was served": ("first_token_refusals", ""),
    "GPU memory held idle, warm (above the GPU's own use)": ("gpu_idle_held_mib", "MiB"),
    "GPU memory held serving (above the GPU's own use)": ("gpu_serving_held_mib", "MiB"),
    "GPU memory used before the pod started": ("gpu_before_mib", "MiB"),
    "restored (vLLM's report)": ("restored", ""),
    "greedy tokens equal the reference run's": ("tokens_equal_reference", ""),
}


def parse_smi(text: str) -> list[int]:
    """`nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits` → MiB per GPU line."""
    out = []
    for line in text.splitlines():
        head = line.split(",")[0].strip()
        if head.isdigit():
            out.append(int(head))
    return out


def held(used: list[int] | None, before: int | None) -> int | None:
    """The median of the samples above the GPU's use before the pod (None without both)."""
    if not used or before is None:
        return None
    return int(statistics.median(used)) - before


def reference(results: dict[str, dict[str, Any]]) -> str | None:
    """The run whose greedy tokens the others are compared with: cold-native's (a fresh engine's
    own graphs), else cold-restored's (restored, which other benches compare with native)."""
    return next((r for r in ("cold-native", "cold-restored") if (results.get(r) or {}).get("tokens")), None)


def run_row(res: dict[str, Any], ref: str | None, ref_tokens: Any) -> dict[str, Any]:
    """One run's figures, as the table shows them."""
    ready = res.get("ready_report") or {}
    before = res.get("gpu_before_mib")
    toks = res.get("tokens")
    return {
        "claim_to_first_token_s": res.get("claim_to_first_token_s"),
        "claim_to_ready_s": (ready.get("stages") or {}).get("claim_to_ready_s"),
        "start_to_ready_s": res.get("start_to_ready_s"),
        "first_token_refusals": res.get("first_token_refusals"),
        "gpu_idle_held_mib": held(res.get("gpu_idle_mib"), before),
        "gpu_serving_held_mib": held(res.get("gpu_serving_mib"), before),
        "gpu_before_mib": before,
        "restored": ready.get("restored"),
        "tokens_equal_reference": None if toks is None or ref_tokens is None or res["run"] == ref
        else toks == ref_tokens,
        "stages": ready.get("stages"),
        "error": res.get("error"),
    }


def _goal(value: Any, limit: float, restored: Any) -> bool | None:
    """Met when measured, restored and within the limit; None when not measured."""
    if value is None:
        return None
    return bool(restored) and value <= limit


def verdicts(rows: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """The goals (None: not measured). A warm pod that captured natively does not meet them."""
    ready, sleeping = rows.get("warm-ready") or {}, rows.get("warm-sleeping") or {}
    idle_r, idle_s = ready.get("gpu_idle_held_mib"), sleeping.get("gpu_idle_held_mib")
    woken = sleeping.get("tokens_equal_reference")
    restored = (rows.get("cold-restored") or {}).get("claim_to_first_token_s")
    own_cache = (rows.get("cold-native-warm-cache") or {}).get("claim_to_first_token_s")
    return {
        f"warm ready: claim → first token ≤ {READY_GOAL_S} s (restored)": _goal(
            ready.get("claim_to_first_token_s"), READY_GOAL_S, ready.get("restored")),
        f"warm sleeping: claim → first token ≤ {SLEEPING_GOAL_S} s (restored)": _goal(
            sleeping.get("claim_to_first_token_s"), SLEEPING_GOAL_S, sleeping.get("restored")),
        "warm sleeping holds less GPU memory idle than warm ready": None if idle_r is None or idle_s is None
        else idle_s < idle_r,
        "tokens after the wake-up equal the reference run's": woken,
        f"cold restored: start → first token ≤ {COLD_GOAL} × vLLM's own warm cache": None
        if restored is None or own_cache is None
        else bool((rows.get("cold-restored") or {}).get("restored")) and restored <= COLD_GOAL * own_cache,
        "every run without an error": None if not rows else not any(r.get("error") for r in rows.values()),
    }


def summarize(results: dict[str, dict[str, Any]], saves: dict[str, dict[str, Any]],
              gpu: dict[str, Any]) -> dict[str, Any]:
    ref = reference(results)
    ref_tokens = (results.get(ref) or {}).get("tokens") if ref else None
    rows = {name: run_row(res, ref, ref_tokens) for name, res in results.items()}
    return {
        "gpu": gpu,
        "tokens_reference": ref,
        "runs": rows,
        "saves": {m: {k: s.get(k) for k in ("identity", "graphs", "bytes", "published", "reused", "error",
                                            "durations")}
                  for m, s in saves.items()},
        "goals": verdicts(rows),
    }


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.3f}{(' ' + unit) if unit else ''}"
    return f"{v}{(' ' + unit) if unit else ''}"


def markdown(model: str, summary: dict[str, Any]) -> str:
    runs = summary["runs"]
    cols = [r for r in RUNS if r in runs] + [r for r in runs if r not in RUNS]
    gpu = summary.get("gpu") or {}
    lines = [
        f"# vLLM warm pods, {model}, {gpu.get('name', 'unknown GPU')}",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `ember bench vllm-warm`: `ember serve --engine vllm` "
        "behind a hand-off written as the sidecar writes it; random weights; each run a fresh process "
        "with an empty vLLM cache (cold-native-warm-cache: the one cold-native left). "
        f"GPU memory by nvidia-smi (total {gpu.get('total_mib', '?')} MiB). "
        f"Greedy tokens compared with {summary.get('tokens_reference') or 'no run'}'s.",
        "",
        "| | " + " | ".join(cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for label, (key, unit) in ROWS.items():
        lines.append(f"| {label} | " + " | ".join(_fmt(runs[c].get(key), unit) for c in cols) + " |")
    lines += ["", "## Goals", "", "| goal | met |", "|---|---|"]
    lines += [f"| {g} | {'not measured' if ok is None else _fmt(ok)} |" for g, ok in summary["goals"].items()]
    errors = {c: runs[c]["error"] for c in cols if runs[c].get("error")}
    errors.update({f"save {m}": s["error"] for m, s in summary["saves"].items() if s.get("error")})
    if errors:
        lines += ["", "## Errors", ""] + [f"- {c}: {e}" for c, e in errors.items()]
    lines += ["", "Stages (ember serve's `ready` report):", ""]
    lines += [f"- {c}: `{json.dumps(runs[c].get('stages'))}`" for c in cols]
    return "\n".join(lines) + "\n"


def report_paths(model: str, gpu: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    slug = "".join(c if c.isalnum() else "-" for c in str(gpu.get("name", "unknown")).lower()).strip("-")
    return out_dir / f"vllm-warm-{slug}-{model}.json", out_dir / f"vllm-warm-{slug}-{model}.md"


def earlier(model: str, gpu: dict[str, Any], out_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results, saves) of an earlier invocation's report on this GPU and model, to go on from."""
    js = report_paths(model, gpu, out_dir)[0]
    try:
        data = json.loads(js.read_text())
    except (OSError, ValueError):
        return {}, {}
    return dict(data.get("results") or {}), dict(data.get("saves") or {})


def write_report(model: str, results: dict[str, dict[str, Any]], saves: dict[str, dict[str, Any]],
                 gpu: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    summary = summarize(results, saves, gpu)
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = report_paths(model, gpu, out_dir)
    js.write_text(json.dumps({"summary": summary, "results": results, "saves": saves}, indent=1,
                             default=str) + "\n")
    md.write_text(markdown(model, summary))
    return js, md
