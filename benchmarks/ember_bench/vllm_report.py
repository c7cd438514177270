"""The report of `ember bench vllm`: JSON (every run's result) and a Markdown table."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from ember.engines.vllm import report as reports

STAGES = (
    "init_device",
    "load_model",
    "determine_available_memory",
    "initialize_from_config",
    "compile_or_warm_up_model",
)


def _stage(res: dict[str, Any], name: str) -> Any:
    return ((res.get("ember") or {}).get("stages") or {}).get(name) or {}


def _device() -> str:
    try:
        import torch

        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    except Exception:
        return "unknown-device"


def _store_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) if store.exists() else 0


def summarize(results: dict[str, dict[str, Any]], store: Path) -> dict[str, Any]:
    native = results.get("native") or {}
    rows = {}
    for mode, res in results.items():
        cap = _stage(res, "capture")
        toks = res.get("tokens")
        rows[mode] = {
            "rc": res.get("rc"),
            "first_token_s": res.get("first_token_s"),
            "engine_init_s": res.get("engine_init_s"),
            "import_s": res.get("import_s"),
            "compilation_time_s": res.get("compilation_time_s"),
            "capture_how": cap.get("how"),
            "capture_s": cap.get("seconds"),
            "compile_cache_put_back_s": _stage(res, "compile_cache").get("seconds"),
            "compile_cache_bytes": _stage(res, "compile_cache").get("bytes"),
            "graphs_captured_at_start": res.get("graphs_captured_at_start"),
            "graphs_captured_serving": res.get("graphs_captured_serving"),
            "tokens_identical_to_native": (toks == native.get("tokens"))
            if toks and mode != "native"
            else None,
            "stages_s": {s: _stage(res, f"worker.{s}").get("seconds") for s in STAGES},
            "kv_cache_memory_bytes": res.get("kv_cache_memory_bytes"),
            "num_gpu_blocks": res.get("num_gpu_blocks"),
            "verify_ms": reports.verify_cost(res.get("ember") or {}).get("verify_ms"),  # LOAD's canary
            "verify_parts_ms": reports.verify_cost(res.get("ember") or {}).get("parts_ms"),
            "refusal": next(
                (
                    _stage(res, s).get("reason")
                    for s in ("load_refused", "save_refused", "refused")
                    if _stage(res, s)
                ),
                None,
            ),
        }
    save = _stage(results.get("save") or {}, "save")
    load = _stage(results.get("load") or {}, "load")
    return {
        "runs": rows,
        "archive_bytes": save.get("bytes") or _store_bytes(store),
        "save": {
            k: save.get(k)
            for k in (
                "graphs",
                "groups",
                "bytes",
                "durations",
                "bitwise_proven",
                "within_native_spread",
                "published",
                "identity",
            )
        },
        "load": load,
    }


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return "—" if v is None else str(v)


def markdown(model: str, layers: int, device: str, summary: dict[str, Any]) -> str:
    runs = summary["runs"]
    cols = list(runs)
    lines = [
        f"# vLLM 0.26 start-up, {model}{f' ({layers} layers)' if layers else ''}, {device}",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `ember bench vllm`; random weights, FULL_AND_PIECEWISE, "
        "default capture sizes, engine core in-process. Archive bytes: "
        f"{summary['archive_bytes']}.",
        "",
        "| | " + " | ".join(cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    keys = [
        "first_token_s",
        "engine_init_s",
        "import_s",
        "compilation_time_s",
        "capture_how",
        "capture_s",
        "compile_cache_put_back_s",
        "compile_cache_bytes",
        "graphs_captured_at_start",
        "graphs_captured_serving",
        "tokens_identical_to_native",
        "kv_cache_memory_bytes",
        "verify_ms",
        "refusal",
    ]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(_fmt(runs[c].get(k)) for c in cols) + " |")
    for s in STAGES:
        lines.append(f"| worker.{s} s | " + " | ".join(_fmt(runs[c]["stages_s"].get(s)) for c in cols) + " |")
    lines += [
        "",
        "SAVE: `" + json.dumps(summary["save"], default=str)[:1500] + "`",
        "",
        "LOAD: `" + json.dumps(summary["load"], default=str)[:1500] + "`",
        "",
    ]
    return "\n".join(lines)


def write_report(
    model: str, layers: int, results: dict[str, dict[str, Any]], out_dir: Path, store: Path
) -> None:
    device = _device()
    name = f"vllm-{device}-{model}{f'-{layers}l' if layers else ''}"
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(results, store)
    (out_dir / f"{name}.json").write_text(
        json.dumps({"summary": summary, "results": results}, indent=1, default=str)
    )
    (out_dir / f"{name}.md").write_text(markdown(model, layers, device, summary))
    print(markdown(model, layers, device, summary))
