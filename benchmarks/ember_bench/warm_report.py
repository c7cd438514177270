"""What the reports of the warm-pod benches share (`vllm_warm_report`, `cb_warm_report`): a run's
figures as the table shows them, the greedy-token reference, the Markdown table, the JSON and
Markdown files (`<bench>-<gpu>-<model>.{json,md}`) and an earlier invocation's runs to go on from.
Pure: the unit tests feed it results by hand."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Row name → (result key, unit), in the order of the Markdown table.
ROWS: dict[str, tuple[str, str]] = {
    "claim → first token (client)": ("claim_to_first_token_s", "s"),
    "claim → ready (ember serve's report)": ("claim_to_ready_s", "s"),
    "process start → ready (cold) / engine ready (warm)": ("start_to_ready_s", "s"),
    "first-token requests refused before one was served": ("first_token_refusals", ""),
    "GPU memory held idle, warm (the pod's processes)": ("gpu_idle_pod_mib", "MiB"),
    "GPU memory held serving (the pod's processes)": ("gpu_serving_pod_mib", "MiB"),
    "GPU memory held idle, warm (the GPU's use above its use before)": ("gpu_idle_held_mib", "MiB"),
    "GPU memory held serving (the GPU's use above its use before)": ("gpu_serving_held_mib", "MiB"),
    "GPU memory used before the pod started": ("gpu_before_mib", "MiB"),
    "restored (the engine's report)": ("restored", ""),
    "greedy tokens equal the reference run's": ("tokens_equal_reference", ""),
}

Verdicts = Callable[[dict[str, dict[str, Any]]], dict[str, bool | None]]


def median(used: list[int] | None) -> int | None:
    return int(statistics.median(used)) if used else None


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
    """One run's figures, as the table shows them. `restored`, `stages` and `claim_to_ready_s`
    are the run's own when it has them (ember serve's /health), else its ready report's (vLLM's)."""
    ready = res.get("ready_report") or {}
    stages = res["stages"] if "stages" in res else ready.get("stages")
    before = res.get("gpu_before_mib")
    toks = res.get("tokens")
    return {
        "claim_to_first_token_s": res.get("claim_to_first_token_s"),
        "claim_to_ready_s": res.get("claim_to_ready_s", (stages or {}).get("claim_to_ready_s")),
        "start_to_ready_s": res.get("start_to_ready_s"),
        "first_token_refusals": res.get("first_token_refusals"),
        "gpu_idle_pod_mib": median(res.get("gpu_idle_pod_mib")),
        "gpu_serving_pod_mib": median(res.get("gpu_serving_pod_mib")),
        "gpu_idle_held_mib": held(res.get("gpu_idle_mib"), before),
        "gpu_serving_held_mib": held(res.get("gpu_serving_mib"), before),
        "gpu_before_mib": before,
        "restored": res["restored"] if "restored" in res else ready.get("restored"),
        "tokens_equal_reference": None if toks is None or ref_tokens is None or res["run"] == ref
        else toks == ref_tokens,
        "stages": stages,
        "error": res.get("error"),
    }


def goal(value: Any, limit: float, restored: Any) -> bool | None:
    """Met when measured, restored and within the limit; None when not measured."""
    if value is None:
        return None
    return bool(restored) and value <= limit


def no_error(rows: dict[str, dict[str, Any]]) -> bool | None:
    return None if not rows else not any(r.get("error") for r in rows.values())


def summarize(results: dict[str, dict[str, Any]], saves: dict[str, dict[str, Any]],
              gpu: dict[str, Any], verdicts: Verdicts) -> dict[str, Any]:
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


def fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.3f}{(' ' + unit) if unit else ''}"
    return f"{v}{(' ' + unit) if unit else ''}"


def tables(summary: dict[str, Any], order: tuple[str, ...]) -> list[str]:
    """The Markdown of the runs (columns in `order`, then any other), the goals, the errors and
    the stages of every run."""
    runs = summary["runs"]
    cols = [r for r in order if r in runs] + [r for r in runs if r not in order]
    lines = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for label, (key, unit) in ROWS.items():
        lines.append(f"| {label} | " + " | ".join(fmt(runs[c].get(key), unit) for c in cols) + " |")
    lines += ["", "## Goals", "", "| goal | met |", "|---|---|"]
    lines += [f"| {g} | {'not measured' if ok is None else fmt(ok)} |" for g, ok in summary["goals"].items()]
    errors = {c: runs[c]["error"] for c in cols if runs[c].get("error")}
    errors.update({f"save {m}": s["error"] for m, s in summary["saves"].items() if s.get("error")})
    if errors:
        lines += ["", "## Errors", ""] + [f"- {c}: {e}" for c, e in errors.items()]
    lines += ["", "Stages (ember serve's report):", ""]
    lines += [f"- {c}: `{json.dumps(runs[c].get('stages'))}`" for c in cols]
    return lines


def report_paths(bench: str, model: str, gpu: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    slug = "".join(c if c.isalnum() else "-" for c in str(gpu.get("name", "unknown")).lower()).strip("-")
    return out_dir / f"{bench}-{slug}-{model}.json", out_dir / f"{bench}-{slug}-{model}.md"


Results = dict[str, dict[str, Any]]


def earlier(bench: str, model: str, gpu: dict[str, Any], out_dir: Path) -> tuple[Results, Results]:
    """(results, saves) of an earlier invocation's report on this GPU and model, to go on from."""
    js = report_paths(bench, model, gpu, out_dir)[0]
    try:
        data = json.loads(js.read_text())
    except (OSError, ValueError):
        return {}, {}
    return dict(data.get("results") or {}), dict(data.get("saves") or {})


def write(bench: str, model: str, results: dict[str, dict[str, Any]], saves: dict[str, dict[str, Any]],
          summary: dict[str, Any], markdown: str, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = report_paths(bench, model, gpu=summary.get("gpu") or {}, out_dir=out_dir)
    js.write_text(json.dumps({"summary": summary, "results": results, "saves": saves}, indent=1,
                             default=str) + "\n")
    md.write_text(markdown)
    return js, md


def go_on_from(earlier_runs: tuple[Results, Results], ids: dict[str, str],
               runs: tuple[str, ...], store: Path) -> tuple[Results, Results]:
    """Of an earlier invocation's (results, saves): the runs of the same deployments (`ids`: mode →
    identity hash) not given again (`runs`), and the SAVEs whose archives are still in `store`."""
    results, saves = earlier_runs
    kept = {r: res for r, res in results.items() if res.get("identity") == ids.get(res.get("mode", ""))
            and r not in runs}
    return kept, {m: s for m, s in saves.items()
                  if s.get("identity") == ids.get(m) and (store / "archives" / ids[m] / "manifest").is_file()}
