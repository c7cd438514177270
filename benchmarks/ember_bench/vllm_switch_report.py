"""The report of `ember bench vllm-switch`: a summary (plan, SAVEs, each switch, the old shape's
service, tokens, goals) as JSON with every raw result, and a Markdown page that says what each
figure includes."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from ember_bench.vllm_report import STAGES
from ember_bench.vllm_switch_plan import Plan, window

MET, NOT_MET, NOT_MEASURED = "met", "not met", "not measured"
INIT_RATIO_GOAL = 0.15  # issue 36: engine init LOAD ÷ native at every shape
SPLICE_GOAL_MS = 20.0  # issue 36: per rank

INCLUDES = {
    "switch_to_first_token_s": "from the moment the bench starts the new shape's process to its first "
    "token (one request, one token): process start, `import vllm`, the engine's start (config, "
    "workers, weights, compile or the archive's compiled code, KV cache, graphs captured or "
    "restored) and the request; nothing is started ahead of the switch",
    "page_cache": "the SAVE Jobs and the old shape imported vLLM and read the model before, so "
    "their files are in the page cache, as on a node that already serves; the restored run reads "
    "its archive from a local store on this disk (a pod's sidecar fetch from S3 is not in it)",
    "engine_init_s": "vLLM's AsyncLLM construction in the new process (no import, no request)",
    "import_s": "`import vllm` and its engine modules (`arg_utils`, `async_llm`) in the new process, "
    "as `ember bench vllm` counts them",
    "latency": "the old shape's requests sent in the window: send → last token (its tokens each)",
    "graphs": "vLLM's compilation_counter.num_cudagraph_captured in each worker, at the end of "
    "start-up and its growth while serving (the plugin's `cudagraphs` stage)",
    "verify_ms": "LOAD's canary on each rank (the plugin's `verify` stage, docs/runtime.md): "
    "its steps through the restored graphs and their reference, before the engine serves; — "
    "where no graph was restored",
    "save_job_s": "the SAVE Job of one identity (sizing probe and SAVE processes, on one GPU), "
    "done before the old shape starts: not part of any switch",
}


def per_rank(res: dict[str, Any]) -> dict[str, Any]:
    """Each rank's figures (a world of one: the report itself as rank 0)."""
    from ember_bench.vllm_parallel import per_rank as parallel_ranks

    rep = res.get("ember") or {}
    ranks = rep.get("ranks") or ({"0": rep} if rep.get("stages") else {})
    out = parallel_ranks({"ember": {"ranks": ranks}})
    for r, one in ranks.items():
        st = one.get("stages") or {}
        graphs = st.get("cudagraphs") or {}
        timings = (st.get("load") or {}).get("timings") or {}
        out[r].update(graphs_captured_at_start=graphs.get("at_start"),
                      graphs_captured_serving=graphs.get("serving"),
                      verify_ms=timings.get("verify_ms"))  # LOAD's canary, where the adapter has one
    return out


def compare_tokens(restored: Any, native: Any) -> dict[str, Any]:
    """Restored vs native tokens per batch size (and per DP rank when the new shape has them)."""
    if not restored or not native:
        return {"identical": None, "why": "a run has no tokens", "cases": {}, "dp_ranks": {}}
    cases: dict[str, bool] = {}
    ranks: dict[str, bool] = {}
    for b, want in native.items():
        got = restored.get(b)
        if isinstance(want, dict):
            for rank, toks in want.items():
                same = isinstance(got, dict) and got.get(rank) == toks
                cases[f"B={b} {rank}"] = same
                ranks[rank] = ranks.get(rank, True) and same
        else:
            cases[f"B={b}"] = got == want
    return {"identical": all(cases.values()) and set(restored) == set(native), "cases": cases,
            "dp_ranks": ranks}


def _switch_row(res: dict[str, Any]) -> dict[str, Any]:
    from ember.engines.vllm import report as reports

    ranks = per_rank(res)
    return {
        "rc": res.get("rc"),
        "switch_to_first_token_s": res.get("switch_to_first_token_s"),
        "process_first_token_s": res.get("first_token_s"),
        "import_s": res.get("import_s"),
        "engine_init_s": res.get("engine_init_s"),
        "generate_s": res.get("generate_s"),
        "restored_every_rank": reports.ranks_restored(res.get("ember") or {}),
        "ranks": ranks,
    }


def service(old: dict[str, Any], switches: dict[str, Any]) -> dict[str, Any]:
    """The old shape's trickle: before any switch, and in each switch's windows."""
    reqs = old.get("requests") or []
    ready = old.get("first_token_mono")
    if not ready:
        return {}
    starts = [s["switch_mono"] for s in switches.values() if s.get("switch_mono")]
    out: dict[str, Any] = {"before": window(reqs, ready, min(starts) if starts else None)}
    for name, s in switches.items():
        first = s.get("first_token_mono")
        out[name] = {"to_first_token": window(reqs, s["switch_mono"], first) if first else None,
                     "to_exit": window(reqs, s["switch_mono"], s.get("exit_mono"))}
    return out


def summarize(p: Plan, opts: Any, results: dict[str, Any]) -> dict[str, Any]:
    switches = results.get("switches") or {}
    old = results.get("old") or {}
    restored, native = switches.get("restored") or {}, switches.get("native") or {}
    summary: dict[str, Any] = {
        "status": "refused" if p.refusals else "ran",
        "plan": p.as_dict(),
        "options": dataclasses.asdict(opts)
        if dataclasses.is_dataclass(opts) and not isinstance(opts, type) else {},
        "identities": results.get("identities"),
        "saves": {k: _save_row(v) for k, v in (results.get("saves") or {}).items()},
        "old": {"rc": old.get("rc"), "first_token_s": old.get("first_token_s"),
                "restored_every_rank": _switch_row(old)["restored_every_rank"] if old else None,
                "ranks": per_rank(old) if old else {}},
        "switches": {k: _switch_row(v) for k, v in switches.items()},
        "service": service(old, switches),
        "tokens": compare_tokens(restored.get("tokens"), native.get("tokens")),
    }
    summary["goals"] = goals(summary)
    return summary


def _save_row(res: dict[str, Any]) -> dict[str, Any]:
    keys = ("published", "reused", "save_job_s", "graphs", "bytes", "identity", "error", "archive")
    return {k: res.get(k) for k in keys if k in res}


def goals(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 36's goals for the new shape, each met / not met / not measured."""
    sw = summary.get("switches") or {}
    restored, native = sw.get("restored") or {}, sw.get("native") or {}
    ranks = restored.get("ranks") or {}
    out = [
        _goal("restored", "restored new shape: restored on every rank",
              restored.get("restored_every_rank"),
              None if not ranks else bool(restored.get("restored_every_rank"))),
        _graphs_goal(ranks),
        _goal("tokens", "new shape's greedy tokens: restored == native" + _compared(summary["tokens"]),
              summary["tokens"].get("identical"), summary["tokens"].get("identical")),
        _old_serves(summary),
        _ratio_goal(restored, native),
        _splice_goal(ranks),
    ]
    out.append(_faster("sooner", "switch → first token: restored sooner than native", restored, native))
    out.append(_faster("sooner_warm", "switch → first token: restored sooner than native on a warm vLLM "
                       "cache", restored, sw.get("native-warm") or {}))
    return out


def _graphs_goal(ranks: dict[str, Any]) -> dict[str, Any]:
    key, name = "graphs", "restored new shape: 0 graphs captured (at start + while serving, every rank)"
    keys = ("graphs_captured_at_start", "graphs_captured_serving")
    counts = [r.get(k) for r in ranks.values() for k in keys]
    if not counts or None in counts:
        return _goal(key, name, None, None)
    return _goal(key, name, sum(counts), sum(counts) == 0)


def _goal(key: str, name: str, value: Any, ok: bool | None) -> dict[str, Any]:
    verdict = NOT_MEASURED if ok is None else (MET if ok else NOT_MET)
    return {"key": key, "goal": name, "value": value, "verdict": verdict}


def _compared(tokens: dict[str, Any]) -> str:
    ranks = tokens.get("dp_ranks") or {}
    if ranks:
        return f" (each DP rank's own outputs: {', '.join(sorted(ranks))})"
    return " (the engine's one output per request, made by every TP rank together)"


def _old_serves(summary: dict[str, Any]) -> dict[str, Any]:
    """The old shape served every request sent while the new one came up (switch → first token)."""
    key, name = "old_serves", "old shape keeps serving during the switch: 0 failed, some served"
    if (summary.get("old") or {}).get("rc") is not None and not summary["old"].get("first_token_s"):
        return _goal(key, name, "the old shape never served", False)
    svc = summary.get("service") or {}
    wins = [v["to_first_token"] for k, v in svc.items() if k != "before" and v.get("to_first_token")]
    if not wins:
        return _goal(key, name, None, None)
    failed, served = sum(w["failed"] for w in wins), sum(w["served"] for w in wins)
    return _goal(key, name, {"served": served, "failed": failed}, failed == 0 and served > 0)


def _ratio_goal(restored: dict[str, Any], native: dict[str, Any]) -> dict[str, Any]:
    a, b = restored.get("engine_init_s"), native.get("engine_init_s")
    ratio = round(a / b, 3) if a and b else None
    name = f"engine init restored ÷ native ≤ {INIT_RATIO_GOAL} (beside a serving engine)"
    return _goal("init_ratio", name, ratio, None if ratio is None else ratio <= INIT_RATIO_GOAL)


def _splice_goal(ranks: dict[str, Any]) -> dict[str, Any]:
    ms = [r.get("splice_ms") for r in ranks.values()]
    if not ms or None in ms:
        return _goal("splice", f"splice ≤ {SPLICE_GOAL_MS:.0f} ms per rank", None, None)
    return _goal("splice", f"splice ≤ {SPLICE_GOAL_MS:.0f} ms per rank", max(ms),
                 max(ms) <= SPLICE_GOAL_MS)


def _faster(key: str, name: str, restored: dict[str, Any], native: dict[str, Any]) -> dict[str, Any]:
    a, b = restored.get("switch_to_first_token_s"), native.get("switch_to_first_token_s")
    value = {"restored_s": a, "native_s": b, "saved_s": round(b - a, 3) if a and b else None}
    return _goal(key, name, value, None if not (a and b) else a < b)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    return "—" if v is None else str(v)


def _header(model: str, layers: int, device: str, summary: dict[str, Any]) -> list[str]:
    p = summary["plan"]
    if summary["status"] == "refused":
        return [f"# vLLM parallelism switch {p['old']} → {p['new']}, {model}, {device}: NOT RUN", "",
                f"`ember bench vllm-switch` refused on {time.strftime('%Y-%m-%d')}; GPUs visible: "
                f"{', '.join(p['gpus']) or 'none'}.", ""]
    return [
        f"# vLLM parallelism switch {p['old']} → {p['new']}, {model}"
        f"{f' ({layers} layers)' if layers else ''}, {device}",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `ember bench vllm-switch`; random weights, "
        "FULL_AND_PIECEWISE, capture sizes 1-16, vLLM's async engine (as `vllm serve`). The old shape "
        f"serves on GPUs {','.join(p['old_gpus'])}; the new one starts on GPUs {','.join(p['new_gpus'])} "
        f"beside it (shared: {','.join(p['shared_gpus']) or 'none'}), each engine at "
        f"{p['memory_fraction']} of every GPU's memory; SAVEs on GPU {p['save_gpu']}.",
        "",
    ]


def _goals_md(summary: dict[str, Any]) -> list[str]:
    lines = ["## Goals", "", "| goal | value | verdict |", "|---|---|---|"]
    lines += [f"| {g['goal']} | {_fmt(g['value'])} | {g['verdict']} |" for g in summary["goals"]]
    return [*lines, ""]


def _switches_md(summary: dict[str, Any]) -> list[str]:
    sw = summary["switches"]
    cols = list(sw)
    keys = ("switch_to_first_token_s", "process_first_token_s", "import_s", "engine_init_s",
            "generate_s", "restored_every_rank", "rc")
    lines = ["## The new shape's start", "", "| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(_fmt(sw[c].get(k)) for c in cols) + " |" for k in keys]
    lines += ["", "Per rank (worker stages, s: init_device / load_model / determine_available_memory / "
              "initialize_from_config / compile_or_warm_up_model):", "",
              "| run | rank | how | refusal | LOAD/capture s | splice ms | graphs at start | "
              "graphs serving | verify ms | worker stages s |", "|---" * 10 + "|"]
    runs = {"old (serving)": (summary.get("old") or {}).get("ranks") or {}}
    runs.update({c: sw[c]["ranks"] for c in cols})
    for c, ranks in runs.items():
        for r, one in ranks.items():
            st = one.get("worker_stages_s") or {}
            stages = " / ".join(_fmt(st.get(s)) for s in STAGES)
            lines.append(f"| {c} | {r} | {_fmt(one.get('capture_how'))} | {_fmt(one.get('refusal'))} | "
                         f"{_fmt(one.get('capture_s'))} | {_fmt(one.get('splice_ms'))} | "
                         f"{_fmt(one.get('graphs_captured_at_start'))} | "
                         f"{_fmt(one.get('graphs_captured_serving'))} | {_fmt(one.get('verify_ms'))} | "
                         f"{stages} |")
    return [*lines, ""]


def _service_md(summary: dict[str, Any]) -> list[str]:
    svc = summary.get("service") or {}
    lines = ["## The old shape's service", "", "| window | s | sent | served | failed | p50 s | p99 s | "
             "max s |", "|---" * 8 + "|"]
    rows = [("before any switch", svc.get("before"))]
    for name, v in svc.items():
        if name != "before":
            rows += [(f"{name}: switch → first token", v.get("to_first_token")),
                     (f"{name}: switch → exit", v.get("to_exit"))]
    for label, w in rows:
        if w:
            lines.append(f"| {label} | {_fmt(w['seconds'])} | {w['sent']} | {w['served']} | {w['failed']} | "
                         f"{_fmt(w['latency_p50_s'])} | {_fmt(w['latency_p99_s'])} | "
                         f"{_fmt(w['latency_max_s'])} |")
    return [*lines, ""]


def markdown(model: str, layers: int, device: str, summary: dict[str, Any]) -> str:
    lines = _header(model, layers, device, summary)
    if summary["status"] == "refused":
        lines += ["**Not run on this machine:**", ""] + [f"- {r}" for r in summary["plan"]["refusals"]]
        return "\n".join([*lines, ""])
    old = summary.get("old") or {}
    lines += [f"Old shape: first token {_fmt(old.get('first_token_s'))} s after its process started, "
              f"restored on every rank: {_fmt(old.get('restored_every_rank'))}, "
              f"rc {_fmt(old.get('rc'))}.", ""]
    lines += _goals_md(summary) + _switches_md(summary) + _service_md(summary)
    lines += ["## SAVE", "", "| shape | published | reused | SAVE Job s | error |", "|---|---|---|---|---|"]
    for label, row in summary["saves"].items():
        lines.append(f"| {label} ({summary['plan'][label]}) | {_fmt(row.get('published'))} | "
                     f"{_fmt(row.get('reused'))} | {_fmt(row.get('save_job_s'))} | "
                     f"{_fmt(row.get('error'))} |")
    tokens = summary["tokens"]
    lines += ["", "## Tokens", "", f"Restored vs native, identical: {_fmt(tokens.get('identical'))}. "
              + "; ".join(f"{k}: {'same' if v else 'DIFFERENT'}" for k, v in tokens["cases"].items()), "",
              "## What each figure includes", ""]
    lines += [f"- `{k}`: {v}." for k, v in INCLUDES.items()]
    return "\n".join([*lines, ""])


def write_report(p: Plan, opts: Any, results: dict[str, Any], out_dir: Path) -> Path:
    """JSON (summary and every raw result) and Markdown under `out_dir`; the JSON's path."""
    from ember_bench.vllm_report import _device

    device = _device()
    model, layers = getattr(opts, "model", "model"), int(getattr(opts, "layers", 0) or 0)
    name = f"vllm-switch-{device}-{model}{f'-{layers}l' if layers else ''}-{p.old.name}-to-{p.new.name}"
    summary = summarize(p, opts, results)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"summary": summary, "results": results}, indent=1, default=str))
    text = markdown(model, layers, device, summary)
    (out_dir / f"{name}.md").write_text(text)
    print(text)
    return path
