"""`ember bench graphs`: native warmup+capture against SAVE → LOAD in a FRESH process, same run.

For each workload, three child processes run one after another on the same GPU:
1. native  - no libember: build, warm up + capture every size (timed), TPOT, greedy decode
             token hashes, output fingerprints;
2. save    - `ember save` under libember (EMBER_MODE=save): capture, walk, prove, publish;
3. load    - under libember (EMBER_MODE=load), perturbed first (allocations before arming) with
             the default allocator: LOAD (timed), template switches (timed), TPOT, decode tokens
             and output fingerprints compared with SAVE's and the native run's.
The report (JSON + markdown) goes to benchmarks/results/graphs-<device>-<date>.{json,md}.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ember_bench import kernel_profile, tpot, true_cost

GOALS = {
    "native_over_load": 30.0,
    "load_ms": 250.0,
    "switch_p50_ms": 1.0,
    "tpot_ratio": 1.01,
    "archive_bytes": 250e6,
}
TPOT_BATCHES = (1, 64)
DECODE_BATCHES = (1, 8, 64)


def _present(sizes: list[int], wanted: tuple[int, ...]) -> list[int]:
    return [b for b in wanted if b in sizes]


# ---- child roles ---------------------------------------------------------------------------------
def role_native(args: dict[str, Any]) -> dict[str, Any]:
    from ember.engines.decode.workloads import make_workload, parse_sizes
    from ember.runtime.proof.replay import decode_trace, replay_fingerprints, tpot_ms
    from ember.runtime.session import ensure_context

    ensure_context()
    w = make_workload(args["workload"], args["layers"], parse_sizes(args["sizes"]))
    out = build_and_capture(w)
    launch = lambda k: w.graphs[k].replay()  # noqa: E731
    out["tpot_ms"] = {str(b): tpot_ms(w, launch, b) for b in _present(list(w.sizes), TPOT_BATCHES)}
    out["tpot_reinstantiated_ms"] = tpot.reinstantiated(w, _present(list(w.sizes), TPOT_BATCHES))
    kernel_profile.maybe_profile("native", launch, _present(list(w.sizes), TPOT_BATCHES))
    traces = {str(b): decode_trace(w, launch, b) for b in _present(list(w.sizes), DECODE_BATCHES)}
    again = {str(b): decode_trace(w, launch, b) for b in _present(list(w.sizes), DECODE_BATCHES)}
    out["decode_sha256"] = {b: t["sha256"] for b, t in traces.items()}
    out["decode_steps"] = {b: t["steps"] for b, t in traces.items()}
    # Control: the same native graphs decoding again in this process.
    out["decode_repeat_identical"] = {b: again[b]["sha256"] == t["sha256"] for b, t in traces.items()}
    out["fingerprints"] = replay_fingerprints(w, launch, [(b,) for b in w.sizes], lambda k: list(w.outs[k]))
    out["graphs"] = len(w.graphs)
    return out


def build_and_capture(w: Any) -> dict[str, Any]:
    """The native start, timed: build the workload, then warm up + capture every size."""
    import torch

    t = time.perf_counter()
    w.build()
    out: dict[str, Any] = {"build_s": time.perf_counter() - t, "device": torch.cuda.get_device_name()}
    t = time.perf_counter()
    w.capture()
    out["native_capture_s"] = time.perf_counter() - t
    return out


def role_load(args: dict[str, Any]) -> dict[str, Any]:
    from ember.engines.decode.adapter import load_workload
    from ember.engines.decode.workloads import replay_verify_loaded
    from ember.handoff import load_attempt
    from ember.runtime.adapter import Refused
    from ember.runtime.proof.replay import decode_trace, tpot_ms

    try:
        loaded = load_workload(args["store"], args["identity"], perturb_first=True, log=lambda m: None)
    except Refused as exc:
        return {"refused": exc.reason}
    out: dict[str, Any] = {"timings": loaded.timings, "load_ms": loaded.timings["load_ms"]}
    lib, w = loaded.library, loaded.workload
    run_dir = args.get("run_dir") or tempfile.mkdtemp(prefix="ember-run-")
    with load_attempt(run_dir=run_dir, identity=args["identity"]):
        sizes = [k[0] for k in lib.keys]
        lib.own.hot_after = 0  # measure the template path only
        first = []
        for i in range(len(lib.keys)):
            t = time.perf_counter()
            lib.exec_for(i)
            first.append((time.perf_counter() - t) * 1e3)
        lib.switch_ms.clear()
        for _ in range(3):
            for i in range(len(lib.keys)):
                lib.exec_for(i)
        sw = sorted(lib.switch_ms)
        out["switch_ms"] = (
            {"p50": statistics.median(sw), "p99": sw[int(0.99 * (len(sw) - 1))], "n": len(sw)} if sw else {}
        )
        out["first_switch_ms_p50"] = statistics.median(first)
        tpot_batches = _present(sizes, TPOT_BATCHES)
        out["tpot_template_ms"] = {str(b): tpot_ms(w, loaded.launch, b) for b in tpot_batches}
        traces = {str(b): decode_trace(w, loaded.launch, b) for b in _present(sizes, DECODE_BATCHES)}
        out["decode_sha256"] = {b: t["sha256"] for b, t in traces.items()}
        out["decode_steps"] = {b: t["steps"] for b, t in traces.items()}
        out["replay"] = replay_verify_loaded(loaded)
    from ember.runtime.proof.replay import replay_fingerprints

    out["fingerprints"] = replay_fingerprints(
        w, loaded.launch, [tuple(k) for k in lib.keys], lambda k: loaded.outputs[k]
    )
    # TPOT as an engine sees it once serving: the library's default policy (a key launched through
    # an updated template gets a dedicated exec in the background), after that exec is ready.
    # tpot_template_ms above is the bridge a key rides on until then (the template, updated to it).
    lib.own.hot_after = 1
    for b in _present(sizes, TPOT_BATCHES):
        loaded.launch((b,))
    lib.own.settle()
    out["dedicated_execs"] = len(lib.own.execs)
    out["tpot_ms"] = {str(b): tpot_ms(w, loaded.launch, b) for b in _present(sizes, TPOT_BATCHES)}
    kernel_profile.maybe_profile("load", loaded.launch, _present(sizes, TPOT_BATCHES))
    out["tpot_same_process"] = tpot.same_process(w, loaded.launch, _present(sizes, TPOT_BATCHES))
    out["saved_decode_sha256"] = loaded.archive.engine.get("decode_sha256", {})
    out["saved_fingerprints"] = loaded.archive.engine.get("fingerprints", {})
    out["saved_decode_steps"] = loaded.archive.engine.get("decode_steps", {})
    from ember.runtime.graphs.rebuild import edge_strategy

    out["edge_strategy"] = edge_strategy()
    return out


def _child(role: str, args: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    args = {**args, "out": path}
    cmd = [sys.executable, "-m", "ember_bench.graphs", role, json.dumps(args)]
    proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-4000:])
    if proc.returncode != 0:
        return {"error": f"{role} exited {proc.returncode}", "stderr": proc.stderr[-2000:]}
    return json.loads(Path(path).read_text())


def _save_child(
    workload: str, layers: int, sizes: str, store: str, env: dict[str, str], timeout: float
) -> dict[str, Any]:
    args = ["--workload", workload, "--layers", str(layers), "--sizes", sizes, "--store", store]
    return run_save([*args, "--tpot", ",".join(map(str, TPOT_BATCHES))], env, timeout)


def run_save(args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """`ember save <args>` in a child process: its JSON summary, or {"error", "stderr"}."""
    from ember.runtime.session import ember_argv

    proc = subprocess.run(ember_argv("save", *args), env=env, timeout=timeout, capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-4000:])
    if proc.returncode != 0:
        return {"error": f"save exited {proc.returncode}", "stderr": proc.stderr[-3000:]}
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def bench_one(
    workload: str, layers: int, sizes: str, store: str, timeout: float = 900, repeats: int = 0
) -> dict[str, Any]:
    """One workload: native, SAVE, LOAD children; with `repeats`, LOAD's true cost too (true_cost)."""
    from ember.runtime.session import preload_env

    base_env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "EMBER_MODE")}
    base_env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # the default allocator (the harder case)
    args = {"workload": workload, "layers": layers, "sizes": sizes}
    res: dict[str, Any] = {"workload": workload, "layers": layers or "model"}
    t = time.perf_counter()
    native = _child("native", args, base_env, timeout)
    res["native_wall_s"] = time.perf_counter() - t
    t = time.perf_counter()
    saved = _save_child(workload, layers, sizes, store, preload_env("save", base_env), timeout)
    res["save_wall_s"] = time.perf_counter() - t
    res["device"] = native.get("device")
    if "native_capture_s" in native:
        res["native_capture_s"] = native["native_capture_s"]
        res["graphs"] = native.get("graphs")
    if "tpot_ms" in native:  # native facts stand on their own, even when SAVE refuses
        res["tpot_native_ms"] = native["tpot_ms"]
        res["tpot_reinstantiated_ms"] = native.get("tpot_reinstantiated_ms", {})
        res["tokens_control_native_repeat"] = native.get("decode_repeat_identical", {})
    if "error" in saved or "error" in native:
        res.update(
            native_error=native.get("error"),
            save_error=saved.get("error"),
            stderr=(saved.get("stderr") or native.get("stderr") or "")[-1500:],
        )
        return res
    t = time.perf_counter()
    loaded = _child(
        "load",
        {**args, "store": store, "identity": saved["identity"]},
        # the template path is measured here (switches, TPOT through an updated template): no
        # background own execs; true_cost's children run with them, as a pod does
        {**preload_env("load", base_env), "EMBER_DEDICATE": "0"},
        timeout,
    )
    res["load_wall_s"] = time.perf_counter() - t
    _save_facts(res, native, saved)
    if "error" in loaded or "refused" in loaded:
        res["load_error"] = loaded.get("error") or f"refused: {loaded.get('refused')}"
        res["stderr"] = loaded.get("stderr", "")[-1500:]
        return res
    _load_facts(res, native, saved, loaded)
    if repeats:
        tc = true_cost.measure(store, saved["identity"], preload_env("load", base_env), repeats, timeout)
        res["true_cost"] = tc
        if "error" not in tc:
            res["native_over_warm_load"] = res["native_capture_s"] * 1e3 / tc["warm_ready_ms"]
            res["native_over_cold_load"] = res["native_capture_s"] * 1e3 / max(tc["cold_extra_ms"], 1e-3)
    return res


def _save_facts(res: dict[str, Any], native: dict[str, Any], saved: dict[str, Any]) -> None:
    """What the SAVE child reported (archive, proof), next to the native child's capture time."""
    res["device"] = native.get("device")
    res["graphs"] = saved["graphs"]
    res["groups"] = saved["groups"]
    res["native_capture_s"] = native["native_capture_s"]
    res["archive_bytes"] = saved["bytes"]
    res["save_durations"] = saved["durations"]
    for k in (
        "programmatic_edges",
        "programmatic_edges_intact",
        "edge_strategy",
        "bitwise_proven",
        "union_templates",
        "union_templates_dropped",
        "topology_groups",
        "within_native_spread",
        "native_nondeterministic",
        "nondeterminism_suspects",
        "proof_notes",
    ):
        res[k] = saved.get(k)


def _load_facts(
    res: dict[str, Any], native: dict[str, Any], saved: dict[str, Any], loaded: dict[str, Any]
) -> None:
    """LOAD's figures against native's and SAVE's: time, ratios, switch, TPOT, tokens, outputs."""
    res["load_ms"] = loaded["load_ms"]
    res["load_edge_strategy"] = loaded.get("edge_strategy")
    res["load_timings"] = loaded["timings"]
    res["native_over_load"] = res["native_capture_s"] * 1e3 / res["load_ms"]
    res["verify_ms"] = loaded["timings"].get("verify_ms")  # LOAD's canary: part of load_ms
    # Cold start as a pod sees it: model build + graphs. LOAD builds its templates on a thread
    # while the model builds, so a LOAD build slower than native's is what that overlap costs.
    lt = loaded["timings"]
    res["cold_start_s"] = {
        "native": native["build_s"] + native["native_capture_s"],
        "restored": (lt["build_workload_ms"] + lt["load_ms"]) / 1e3,
        "native_build_s": native["build_s"],
        "restored_build_s": lt["build_workload_ms"] / 1e3,
    }
    res["switch_ms"] = loaded["switch_ms"]
    res["first_switch_ms_p50"] = loaded["first_switch_ms_p50"]
    res["tpot_native_ms"] = native["tpot_ms"]
    res["tpot_restored_ms"] = loaded["tpot_ms"]
    # Control: SAVE's captured graphs in libember's memory layout. Where restored ≈ this and both
    # differ from native, the difference is the layout (physical memory), not the restore.
    res["tpot_save_ms"] = saved.get("tpot_ms", {})
    res["tpot_template_ms"] = loaded.get("tpot_template_ms", {})
    res["tpot_same_process"] = loaded.get("tpot_same_process", {})
    res.update(token_verdicts(native, loaded))
    res["outputs_identical_vs_save"] = loaded["replay"]
    nf, lf = native["fingerprints"], loaded["fingerprints"]
    res["outputs_identical_vs_native"] = sum(nf.get(k) == v for k, v in lf.items())
    # Control for outputs_identical_vs_save: do two NATIVE processes (this run's and SAVE's)
    # agree? A key where they do not is native nondeterminism across processes, not a restore fault.
    sf = loaded.get("saved_fingerprints", {})
    res["outputs_control_native_vs_save"] = {
        "identical": sum(sf.get(k) == v for k, v in nf.items()),
        "differ": [k for k, v in nf.items() if sf.get(k) != v][:10],
    }


def token_verdicts(native: dict[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
    """Restored tokens against the native ones, WITH the controls that make that meaningful.

    Three decodes with native graphs exist: the native process (twice) and the SAVE process
    (its reference, stored in the archive). If they disagree among themselves, native decoding
    is not reproducible and a restored difference is not evidence of a restore failure.
    """
    from ember.runtime.proof.measures import first_divergence

    saved, saved_steps = loaded["saved_decode_sha256"], loaded.get("saved_decode_steps", {})
    out: dict[str, Any] = {
        "tokens_identical": {},
        "tokens_control_native_vs_save": {},
        "tokens_control_native_repeat": native.get("decode_repeat_identical", {}),
        "tokens_first_divergence": {},
        "tokens_verdict": {},
    }
    for b, sha in loaded["decode_sha256"].items():
        control = native["decode_sha256"].get(b) == saved.get(b)
        repeat = native.get("decode_repeat_identical", {}).get(b, True)
        same = sha == saved.get(b)
        out["tokens_identical"][b] = same and sha == native["decode_sha256"].get(b)
        out["tokens_control_native_vs_save"][b] = control
        lsteps = loaded.get("decode_steps", {}).get(b)
        out["tokens_first_divergence"][b] = {
            "restored_vs_save": first_divergence(lsteps, saved_steps.get(b)),
            "native_vs_save": first_divergence(native.get("decode_steps", {}).get(b), saved_steps.get(b)),
        }
        if out["tokens_identical"][b]:
            verdict = "identical"
        elif not (control and repeat):
            verdict = "native decoding not reproducible (control failed): not a restore verdict"
        else:
            verdict = "RESTORE DIFFERS (native decoding reproducible)"
        out["tokens_verdict"][b] = verdict
    return out


def goals(r: dict[str, Any]) -> dict[str, bool | None]:
    if "load_ms" not in r:
        return {}
    # restored vs torch's capture in the same process (either way: faster is a finding too);
    # across processes only when there is no such control (why: tpot.same_process)
    same = r.get("tpot_same_process") or {}
    tp = (
        [max(v / same["captured"][b], same["captured"][b] / v) for b, v in same["restored"].items()]
        if same
        else [
            r["tpot_restored_ms"][b] / r["tpot_native_ms"][b]
            for b in r["tpot_restored_ms"]
            if b in r["tpot_native_ms"]
        ]
    )
    return {
        "native_over_load>=30": r["native_over_load"] >= GOALS["native_over_load"],
        "load_ms<=250": r["load_ms"] <= GOALS["load_ms"],
        "switch_p50<=1ms": (r["switch_ms"].get("p50", 1e9) <= GOALS["switch_p50_ms"])
        if r["switch_ms"]
        else None,
        "tpot_within_1pct": all(x <= GOALS["tpot_ratio"] for x in tp) if tp else None,
        "tokens_identical": tokens_goal(r),
        "archive<=250MB": r["archive_bytes"] <= GOALS["archive_bytes"],
        "programmatic_edges_intact": r.get("programmatic_edges_intact"),
        # every graph's outputs (logits AND tokens) equal SAVE's, where native itself does
        "outputs_identical": outputs_goal(r),
        **true_cost.goals(r.get("true_cost")),
    }


def outputs_goal(r: dict[str, Any]) -> bool | None:
    rep, control = r.get("outputs_identical_vs_save"), r.get("outputs_control_native_vs_save")
    if not rep:
        return None
    unstable = set(control["differ"]) if control else set()
    return set(rep["differ"]) <= unstable and rep["identical"] >= rep["graphs"] - len(unstable)


def tokens_goal(r: dict[str, Any]) -> bool | None:
    """True/False when native decoding is reproducible (controls pass); None when it is not."""
    if not r["tokens_identical"]:
        return None
    if all(r["tokens_identical"].values()):
        return True
    controls = {**r.get("tokens_control_native_vs_save", {})}
    repeat = r.get("tokens_control_native_repeat", {})
    if not all(controls.values()) or not all(repeat.values()):
        return None
    return False


STAGES = (  # the critical path, then the background thread's
    "read_ms",
    "import_alloc_log_ms",
    "release_cache_ms",
    "replay_window_ms",
    "join_ms",
    "reconstruct_ms",
    "read_table_ms",
    "images_handed_first_ms",
    "images_held_ms",  # the first key's images handed: the reader waits for its template's build
    "images_handed_ms",
    "read_blobs_ms",
    "reader_wait_ms",
    "functions_first_ms",
    "library_first_ms",
    "functions_ms",
    "templates_ms",
)


def stages_cell(r: dict[str, Any]) -> str:
    """LOAD's stages; reconstruct (decode, functions, templates) runs on a background thread
    while the model builds, `join` is what the critical path waited for it."""
    lt = r.get("load_timings", {})
    text = ", ".join(f"{k[:-3]} {lt[k]:.0f}" for k in STAGES if isinstance(lt.get(k), int | float))
    if lt.get("image_reader"):
        text += f"; kernel images read by {lt['image_reader']}"
    if lt.get("background_error"):
        text += f"; background build refused, redone after the replay: {lt['background_error'][:120]}"
    ts = r.get("tpot_save_ms") or {}
    if ts:
        text += "; TPOT of SAVE's captured graphs (libember memory) " + ", ".join(
            f"{v:.3f} ({b})" for b, v in ts.items()
        )
    for key, what in (
        ("tpot_template_ms", "restored through the updated template (a key's first steps)"),
        ("tpot_reinstantiated_ms", "captured graphs instantiated by ember instead of torch"),
    ):
        if r.get(key):
            text += f"; {what} " + ", ".join(f"{v:.3f} ({b})" for b, v in r[key].items())
    same = r.get("tpot_same_process") or {}
    for key, what in (("restored", "same process: restored"), ("captured", "torch's capture there")):
        if same.get(key):
            text += f"; {what} " + ", ".join(f"{v:.3f} ({b})" for b, v in same[key].items())
    cs = r.get("cold_start_s")
    if cs:
        text += (
            f"; cold start native {cs['native']:.2f} s (build {cs['native_build_s']:.2f}) vs restored "
            f"{cs['restored']:.2f} s (build {cs['restored_build_s']:.2f})"
        )
    return text


def groups_cell(r: dict[str, Any]) -> str:
    """Templates; with unions, also how many unions and the topology groups there would be."""
    n, unions = r["groups"], r.get("union_templates") or 0
    return f"{n} ({unions} unions; {r['topology_groups']} topology groups)" if unions and r.get(
        "topology_groups") else str(n)


def _table_row(r: dict[str, Any]) -> str:
    """One workload's row of the report's table (or its failure)."""
    if "load_ms" not in r:
        err = r.get("load_error") or r.get("save_error") or r.get("native_error")
        tail = [ln for ln in str(r.get("stderr", "")).splitlines() if ln.strip()]
        err = f"{err}: {tail[-1].strip()[:160]}" if tail else err
        return (
            f"| {r['workload']} | {r.get('graphs', '')} | {r.get('groups', '')} | "
            f"{r.get('native_capture_s', 0):.2f} | FAILED: {err} | | | | | | | | |"
        )
    tp = ", ".join(
        f"{r['tpot_native_ms'][b]:.3f}/{r['tpot_restored_ms'][b]:.3f} ({b})" for b in r["tpot_restored_ms"]
    )
    sw = r["switch_ms"]
    rep = r["outputs_identical_vs_save"]
    label = r["workload"] if r["layers"] == "model" else f"{r['workload']} ({r['layers']} layers)"
    return (
        f"| {label} | {r['graphs']} | "
        f"{groups_cell(r)} | {r['native_capture_s']:.2f} | {r['load_ms']:.1f} | "
        f"{r['native_over_load']:.1f} | "
        f"{sw.get('p50', 0):.3f}/{sw.get('p99', 0):.3f} | {tp} | "
        f"{_yn(r['tokens_identical'])} | "
        f"{_yn(r.get('tokens_control_native_vs_save', {}))}, repeat "
        f"{_yn(r.get('tokens_control_native_repeat', {}))} | "
        f"{rep['identical']}/{rep['graphs']} "
        f"({r.get('outputs_control_native_vs_save', {}).get('identical', '?')}/{rep['graphs']}) | "
        f"{r.get('bitwise_proven')} / {r.get('within_native_spread')} | "
        f"{r['archive_bytes'] / 1e6:.1f} |"
    )


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# ember bench graphs — {report['device']} — {report['date']}",
        "",
        f"parse_ms_512 (synthetic 512 graphs × 1800 nodes, header+index+templates): "
        f"**{report['parse_ms_512']:.1f} ms**",
        "",
        "| workload | graphs | templates | native_capture_s | load_ms | native/load | switch p50/p99 ms | "
        "TPOT native/restored ms (B) | tokens identical (B) | control: native = native | "
        "outputs = SAVE (control: native = SAVE) | bitwise / in spread | archive MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_table_row(r) for r in report["results"]]
    lines += ["", "## LOAD's true cost (medians of fresh processes; ember_bench/true_cost.py)", ""]
    lines += [true_cost.report_line(r) for r in report["results"] if r.get("true_cost")]
    lines += ["", "## LOAD stages (ms) and cold start (model build + graphs)", ""]
    for r in report["results"]:
        if "load_ms" in r:
            lines.append(f"- {r['workload']}: {stages_cell(r)}")
    lines += ["", "## Goals (eager Llama-3-8B shape is the reference)", ""]
    for r in report["results"]:
        g = goals(r)
        missed = [k for k, v in g.items() if v is False]
        lines.append(
            f"- {r['workload']}: "
            + ("all goals met" if g and not missed else f"missed: {', '.join(missed) or 'n/a (did not run)'}")
        )
    for r in report["results"]:
        if r.get("native_nondeterministic"):
            sus = ", ".join(r.get("nondeterminism_suspects") or []) or "none distinct"
            lines.append(
                f"- {r['workload']}: captured graphs NOT bit-stable natively (proven by structure + "
                f"native spread, not bitwise): {', '.join(sorted(r['native_nondeterministic']))}; "
                f"kernels only in those graphs: {sus}"
            )
        for b, v in (r.get("tokens_verdict") or {}).items():
            if v != "identical":
                where = r["tokens_first_divergence"][b]
                lines.append(f"- {r['workload']} B={b}: {v}; first differing step {where}")
    lines += ["", "Per-workload details (LOAD stage timings, SAVE durations) are in the JSON file."]
    return "\n".join(lines) + "\n"


def _yn(d: dict[str, bool]) -> str:
    return ", ".join(f"{b}: {'yes' if v else 'NO'}" for b, v in d.items()) or "n/a"


def bench_graphs(
    workloads: Annotated[
        str, typer.Option(help="Comma-separated workloads (llama3-8b, qwen3-8b-compile, ...).")
    ] = "llama3-8b",
    layers: Annotated[int, typer.Option(help="Layer override for every workload (0 = full model).")] = 0,
    sizes: Annotated[str, typer.Option(help="'all' (67 sizes) or a list like 1,8,64.")] = "all",
    out_dir: Annotated[Path, typer.Option(help="Where the JSON and markdown reports go.")] = Path(
        "benchmarks/results"
    ),
    store: Annotated[
        str, typer.Option(help="Store URI for the archives (default: a temporary directory).")
    ] = "",
    repeats: Annotated[
        int, typer.Option(help="Fresh processes per LOAD true-cost figure (warm, cold, bare build); 0 skips.")
    ] = 3,
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel ranks (one GPU each).")] = 1,
    ep: Annotated[int, typer.Option("--ep", help="Expert-parallel ranks (MoE workloads).")] = 1,
    dp: Annotated[int, typer.Option("--dp", help="Data-parallel ranks.")] = 1,
    collectives: Annotated[
        bool, typer.Option("--collectives", help="Collectives in a world of one: the splice on one GPU.")
    ] = False,
) -> None:
    """Native capture vs SAVE→LOAD in a fresh process, per workload; writes JSON + markdown.
    With --tp/--ep/--dp: native N-rank capture vs one single-GPU SAVE → N-rank LOAD (parallel.py)."""
    from ember_bench.parse import parse_ms_512

    store = store or Path(tempfile.mkdtemp(prefix="ember-bench-store-")).as_uri()
    if max(tp, ep, dp) > 1 or collectives:
        from ember_bench import parallel

        shape = {"layers": layers, "sizes": sizes, "store": store, "tp": tp, "ep": ep, "dp": dp}
        for w in [x.strip() for x in workloads.split(",") if x.strip()]:
            typer.echo(parallel.markdown(parallel.run(out_dir, workload=w, collectives=collectives, **shape)))
        return
    results: list[dict[str, Any]] = []
    parse_ms = parse_ms_512()["parse_ms_512"]
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    report: dict[str, Any] = {}
    for w in [x.strip() for x in workloads.split(",") if x.strip()]:
        typer.echo(f"bench graphs: {w}", err=True)
        r = bench_one(w, layers, sizes, store, repeats=repeats)
        r["goals"] = goals(r)
        results.append(r)
        typer.echo(
            json.dumps({k: v for k, v in r.items() if k not in ("stderr",)}, default=str)[:1500], err=True
        )
        # Written after every workload: a run cut short keeps what it measured.
        device = next((r["device"] for r in results if r.get("device")), "unknown")
        report = {
            "device": device,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "parse_ms_512": parse_ms,
            "results": results,
        }
        stem = f"graphs-{device.replace(' ', '_')}-{stamp}"
        (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
        (out_dir / f"{stem}.md").write_text(markdown(report))
    if report:
        typer.echo(markdown(report))


def _main() -> None:
    role, args = sys.argv[1], json.loads(sys.argv[2])
    out = role_native(args) if role == "native" else role_load(args)
    Path(args["out"]).write_text(json.dumps(out, default=str))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of CUDA state


if __name__ == "__main__":
    _main()
