"""LOAD's true cost, two ways (`ember bench graphs` runs it after its own LOAD child).

`load_ms` counts LOAD's critical path only: the reconstruction (blob reads, table decode,
kernel lookup, templates) runs on a background thread while the model builds, where it can slow
the build. These figures count everything the user waits for:

- warm: a warm pod — the model is built, then the archive comes. Wall time from opening the
  archive until the first needed (smallest) key has run once (`warm_first_ms`: launched and
  synchronised), until every group's template is instantiated (`warm_templates_ms`: any key
  launchable, through an exec update for a key that is not its group's template), until EVERY
  key is launchable through an exec of its own, no update (`warm_ready_ms`: the background
  Dedicator done, `ember.runtime.graphs.need`), and until every key then ran once
  (`warm_all_ms`). Work on background threads counts: every figure waits for it. Beside them,
  when each key became launchable at all (its group's template built and uploaded; a key that
  is not the template's runs through an exec update): the first key, the median key and the
  last in need order (`warm_launchable_ms`; the last is `warm_templates_ms`).
- first use: in that last pass each key's first launch is timed on the host against its second,
  each on an idle GPU (`first_use_extra_ms` p50/p99; without the synchronisation a launch behind
  a full queue blocks until the GPU drains, ~10-20 ms, which is not the key's first-use cost)
  and the exec updates it caused are counted (`first_use_updates`);
  the own execs' device memory (`exec_mb`) and the keys past the cap (`exec_capped`) are kept.
- cold: a pod that starts with its archive. (a process that imports ember's LOAD path, builds
  the model AND restores, until every key is launchable through its own exec and ran once) minus
  (a process that only builds the same model, restoring nothing), both under libember in load
  mode, both timed from the armed session on, both importing torch and the model code in that
  time. Split in two (medians): how much later the restoring process's build ended than a bare
  build does (`cold_build_slowdown_ms`: LOAD's imports and manifest read, and background work
  competing with the build), and how long after its build ended every key became launchable
  (`cold_after_build_ms`). Both processes first import torch, timed on its own
  (`torch_import_ms`); `cold_extra_less_import_ms` is the cold difference with each run's import
  taken out of that run, beside the spread of the bare builds without it: bare builds alone
  spread by seconds, too much to read a 150 ms difference off a few runs.
- variants (`VARIANTS`): a role measured once more with one setting changed (the warm role with
  each pair of templates uploaded on its own thread while the next pair builds, the warm role
  with an archive's union templates ignored: one template per topology group, the cold role
  with the own execs built while the model builds), as `<variant>_first/templates/ready_ms` (warm) or
  `<variant>_ready/extra/templates_ms` with the same split (cold).
  In the warm figures the LOAD path's modules were imported when the process started, as an
  engine that waits for its archive does.

Each in its own fresh process, `repeats` times; the report keeps every run and the medians.
Children: `python -m ember_bench.true_cost ROLE ARGS_JSON`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROLES = ("warm", "cold", "build")
# A role again with one setting changed: what that setting buys, in the same run (name: role, env).
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "warm_uploads_behind": ("warm", {"EMBER_UPLOAD_BEHIND": "1"}),  # pairs upload on their own thread
    # an archive with union templates (SAVE under EMBER_UNION_TEMPLATES=1) LOADed without them
    "warm_topology_groups": ("warm", {"EMBER_UNION_TEMPLATES": "0"}),
    "cold_early": ("cold", {"EMBER_DEDICATE_EARLY": "1"}),  # own execs during the model build
}


def _facts(store: str, identity: str) -> dict[str, Any]:
    from ember.runtime import publish

    return dict(publish.open_archive(store, identity).manifest.engine)


def _import_torch(out: dict[str, Any]) -> None:
    """Both cold-side processes start the same way: importing torch, timed on its own."""
    t = time.perf_counter()
    import torch  # noqa: F401

    out["torch_import_ms"] = (time.perf_counter() - t) * 1e3


def _build(facts: dict[str, Any]) -> Any:
    import torch

    from ember.engines.decode.model import DecodeWorkload

    w = DecodeWorkload.from_config(facts)
    w.build(kv_cache_bytes=int(facts["kv_cache_bytes"]), compile_fn=False)
    torch.cuda.synchronize()
    return w


def _launch_all(loaded: Any, t0: float, out: dict[str, Any], prefix: str) -> None:
    """First key run, templates ready, every key's own exec ready, every key run (ms from t0);
    the first-use cost on the host of each key, and what the own execs cost."""
    import torch

    lib = loaded.library
    order = [tuple(lib.keys[i]) for i in lib.order]
    loaded.launch(order[0])
    torch.cuda.synchronize()
    out[f"{prefix}_first_ms"] = (time.perf_counter() - t0) * 1e3
    lib.wait_templates()
    # when the last one was built: in a cold pod that is during the build, before the first launch
    out[f"{prefix}_templates_ms"] = (lib.marks.get("templates", time.perf_counter()) - t0) * 1e3
    # when each key became launchable (its template ready), over the keys in need order
    ready = [((lib.launchable_at(i) or time.perf_counter()) - t0) * 1e3 for i in lib.order]
    out[f"{prefix}_launchable_ms"] = {
        "first": ready[0], "p50": statistics.median(ready), "all": max(ready)
    }
    lib.own.wait()
    out[f"{prefix}_ready_ms"] = (time.perf_counter() - t0) * 1e3
    updates = len(lib.switch_ms)
    first: list[float] = []
    second: list[float] = []
    for k in order[1:]:
        for times in (first, second):
            torch.cuda.synchronize()  # an idle GPU: a full launch queue would block the launch
            t = time.perf_counter()
            loaded.launch(k)
            times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    out[f"{prefix}_all_ms"] = (time.perf_counter() - t0) * 1e3
    extra = sorted(a - b for a, b in zip(first, second, strict=True)) or [0.0]
    out[f"{prefix}_first_use_extra_ms"] = {
        "p50": statistics.median(extra), "p99": extra[int(0.99 * (len(extra) - 1))], "max": extra[-1]
    }
    out[f"{prefix}_first_use_updates"] = len(lib.switch_ms) - updates
    out[f"{prefix}_marks_ms"] = {k: (v - t0) * 1e3 for k, v in lib.marks.items()}
    st = lib.own.dedicator.stats if lib.own.dedicator is not None else None
    if st is not None:
        out[f"{prefix}_exec_mb"] = st.bytes / 2**20
        out[f"{prefix}_execs"] = st.execs
        out[f"{prefix}_exec_capped"] = len(st.capped)
        out[f"{prefix}_exec_build_ms"] = st.build_ms
        out[f"{prefix}_exec_upload_ms"] = st.upload_ms
        out[f"{prefix}_exec_prepare_ms"] = st.prepare_ms
        out[f"{prefix}_exec_per_graph_ms"] = st.per_graph  # (build, instantiate) in libember
    out[f"{prefix}_templates_waited_ms"] = sum(lib.waited_ms)


def role(name: str, args: dict[str, Any]) -> dict[str, Any]:
    from ember.runtime.session import native_session

    ip = native_session("load")  # armed before anything is built, as in a pod
    out: dict[str, Any] = {"role": name}
    if name == "build":
        facts = _facts(args["store"], args["identity"])
        t0 = time.perf_counter()
        _import_torch(out)
        _build(facts)
        out["build_ms"] = (time.perf_counter() - t0) * 1e3
    elif name == "warm":  # the engine process imported ember's LOAD path when it started
        from ember.engines.decode.adapter import load_workload

        prebuilt = _build(_facts(args["store"], args["identity"]))
        t0 = time.perf_counter()
        loaded = load_workload(args["store"], args["identity"], interposer=ip, prebuilt=prebuilt,
                               log=lambda m: None, wait_templates=False)
        _launch_all(loaded, t0, out, "warm")
        out["warm_load_timings"] = loaded.timings
        if ip is not None:  # each image's load: [bytes, start ms after the first preload, load ms]
            out["warm_catalog"] = ip.stats()["catalog"]
        out["warm_library_timings"] = dataclasses.asdict(loaded.library.timings)
    else:  # cold: importing the LOAD path, the manifest read, the build and the LOAD all timed
        t0 = time.perf_counter()
        _import_torch(out)
        from ember.engines.decode.adapter import load_workload
        from ember.engines.decode.model import DecodeWorkload

        build, built_at = DecodeWorkload.build, []

        def timed_build(*a: Any, **k: Any) -> Any:
            try:
                return build(*a, **k)
            finally:
                built_at.append(time.perf_counter())

        DecodeWorkload.build = timed_build  # type: ignore[method-assign]
        loaded = load_workload(args["store"], args["identity"], interposer=ip, log=lambda m: None,
                               wait_templates=False)
        _launch_all(loaded, t0, out, "cold")
        out["cold_build_ms"] = (built_at[0] - t0) * 1e3  # from t0 like a bare build: imports too
        out["cold_timings"] = loaded.timings
    return out


def run_child(name: str, args: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, "-m", "ember_bench.true_cost", name, json.dumps({**args, "out": path})]
    proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"role": name, "error": f"exited {proc.returncode}", "stderr": proc.stderr[-1500:]}
    return dict(json.loads(Path(path).read_text()))


def measure(
    store: str, identity: str, env: dict[str, str], repeats: int = 3, timeout: float = 600
) -> dict[str, Any]:
    """Warm and cold LOAD cost, `repeats` fresh processes each (interleaved), with medians."""
    args = {"store": store, "identity": identity}
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in (*ROLES, *VARIANTS)}
    for _ in range(repeats):
        for name in ROLES:
            runs[name].append(run_child(name, args, env, timeout))
        for variant, (role_name, changed) in VARIANTS.items():
            runs[variant].append(run_child(role_name, args, {**env, **changed}, timeout))
    errors = [r for rs in runs.values() for r in rs if "error" in r]
    out: dict[str, Any] = {"runs": runs, "repeats": repeats}
    if errors:
        out["error"] = errors[0]
        return out

    def med(role_name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[role_name])

    for role_name in ("warm", "cold"):
        for what in ("first", "templates", "ready", "all"):
            key = f"{role_name}_{what}_ms"
            out[key] = med(role_name, key)
    for what in ("first", "p50"):
        out[f"warm_launchable_{what}_ms"] = statistics.median(
            r["warm_launchable_ms"][what] for r in runs["warm"]
        )
    out["build_only_ms"] = med("build", "build_ms")
    # how far bare builds alone spread: a cold difference smaller than this is not resolved
    builds = [r["build_ms"] for r in runs["build"]]
    out["build_only_range_ms"] = [min(builds), max(builds)]
    out["cold_extra_ms"] = out["cold_ready_ms"] - out["build_only_ms"]  # restoring's cost over a bare build
    out.update(_less_import(runs))
    out["cold_extra_first_ms"] = out["cold_first_ms"] - out["build_only_ms"]
    # where the cold extra goes: the build slowed by the background work, then what is left after it
    out["cold_build_ms"] = med("cold", "cold_build_ms")
    out["cold_build_slowdown_ms"] = out["cold_build_ms"] - out["build_only_ms"]
    tails = [r["cold_ready_ms"] - r["cold_build_ms"] for r in runs["cold"]]
    out["cold_after_build_ms"] = statistics.median(tails)
    for variant, (role_name, _) in VARIANTS.items():
        if role_name == "warm":
            for what in ("first", "templates", "ready"):
                out[f"{variant}_{what}_ms"] = med(variant, f"warm_{what}_ms")
            continue
        for what in ("templates", "ready", "build"):
            out[f"{variant}_{what}_ms"] = med(variant, f"cold_{what}_ms")
        out[f"{variant}_extra_ms"] = out[f"{variant}_ready_ms"] - out["build_only_ms"]
        out[f"{variant}_after_build_ms"] = statistics.median(
            r["cold_ready_ms"] - r["cold_build_ms"] for r in runs[variant]
        )
    for key in ("first_use_updates", "exec_mb", "execs", "exec_capped"):
        vals = [v for r in runs["warm"] if (v := r.get(f"warm_{key}")) is not None]
        out[f"warm_{key}"] = max(vals) if vals else None  # the worst run
    out["first_use_extra_p99_ms"] = max(r["warm_first_use_extra_ms"]["p99"] for r in runs["warm"])
    return out


def _less_import(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """cold_extra_ms with each run's torch import (the same first step in both, before anything of
    ember's runs) taken out: where bare builds spread by their import, what is left."""
    if not all("torch_import_ms" in r for r in [*runs["cold"], *runs["build"]]):
        return {}  # children that did not time it
    less = [r["build_ms"] - r["torch_import_ms"] for r in runs["build"]]
    restored = statistics.median(r["cold_ready_ms"] - r["torch_import_ms"] for r in runs["cold"])
    return {"build_less_import_range_ms": [min(less), max(less)],
            "cold_extra_less_import_ms": restored - statistics.median(less)}


def goals(tc: dict[str, Any] | None) -> dict[str, bool | None]:
    """Issue 17's goals on LOAD's true cost (absent when it was not measured)."""
    if not tc or "error" in tc:
        return {}
    return {
        "warm_every_key_own_exec<=150ms": tc["warm_ready_ms"] <= 150,
        "warm_every_key_launchable<=150ms": tc["warm_templates_ms"] <= 150,  # exec update allowed
        "warm_first_key<=30ms": tc["warm_first_ms"] <= 30,  # launched and run once
        "warm_first_key_launchable<=30ms": tc.get("warm_launchable_first_ms", 1e9) <= 30,
        "cold_extra<=150ms": tc["cold_extra_ms"] <= 150,
        "first_use_no_exec_update": tc.get("warm_first_use_updates") == 0,
        "first_use_p99<=0.1ms": tc.get("first_use_extra_p99_ms", 1e9) <= 0.1,
    }


def _variant_text(tc: dict[str, Any], v: str) -> str:
    role_name, changed = VARIANTS[v]
    head = f"{v} ({', '.join(f'{k}={x}' for k, x in changed.items())}): "
    if role_name == "warm":
        return (f"{head}first key {tc[f'{v}_first_ms']:.0f} ms, every template "
                f"{tc[f'{v}_templates_ms']:.0f} ms, every key own exec {tc[f'{v}_ready_ms']:.0f} ms")
    return (f"{head}adds {tc[f'{v}_extra_ms']:+.0f} ms (its build ends "
            f"{tc[f'{v}_build_ms'] - tc['build_only_ms']:+.0f} ms later, then "
            f"{tc[f'{v}_after_build_ms']:.0f} ms), templates at {tc[f'{v}_templates_ms']:.0f} ms")


def report_line(r: dict[str, Any]) -> str:
    tc = r["true_cost"]
    if "error" in tc:
        return f"- {r['workload']}: true cost not measured: {tc['error']}"
    return (
        f"- {r['workload']} ({tc['repeats']} runs each): warm pod, archive opened → first key "
        f"launchable {tc['warm_launchable_first_ms']:.0f} ms, run {tc['warm_first_ms']:.0f} ms; half the "
        f"keys launchable {tc['warm_launchable_p50_ms']:.0f} ms, every template ready (every key "
        f"launchable) {tc['warm_templates_ms']:.0f} ms, "
        f"**every key launchable through its own exec {tc['warm_ready_ms']:.0f} ms**, every key run "
        f"once {tc['warm_all_ms']:.0f} ms; first use of a key after that: "
        f"{tc.get('warm_first_use_updates')} exec updates, host launch p99 "
        f"+{tc['first_use_extra_p99_ms']:.3f} ms over its second launch; own execs "
        f"{tc.get('warm_execs')} taking {tc.get('warm_exec_mb') or 0:.0f} MiB "
        f"({tc.get('warm_exec_capped')} keys past the cap); cold, build + LOAD until every key is "
        f"launchable {tc['cold_ready_ms']:.0f} ms (first key {tc['cold_first_ms']:.0f} ms) vs a bare "
        f"build {tc['build_only_ms']:.0f} ms (runs {tc['build_only_range_ms'][0]:.0f}-"
        f"{tc['build_only_range_ms'][1]:.0f} ms): LOAD adds {tc['cold_extra_ms']:.0f} ms"
        + (f" ({tc['cold_extra_less_import_ms']:.0f} ms with each run's torch import taken out, bare builds "
           f"then {tc['build_less_import_range_ms'][0]:.0f}-{tc['build_less_import_range_ms'][1]:.0f} ms)"
           if "cold_extra_less_import_ms" in tc else "")
        + f" (its build ends "
        f"{tc['cold_build_slowdown_ms']:+.0f} ms later, then {tc['cold_after_build_ms']:.0f} ms until "
        f"every key is launchable; every template ready at {tc['cold_templates_ms']:.0f} ms); "
        + "; ".join(_variant_text(tc, v) for v in VARIANTS if f"{v}_ready_ms" in tc)
        + "; native capture / "
        f"warm LOAD {r['native_over_warm_load']:.1f}x, / cold extra {r['native_over_cold_load']:.1f}x "
        f"(critical-path load_ms {r['load_ms']:.1f})"
    )


def _main() -> None:
    name, args = sys.argv[1], json.loads(sys.argv[2])
    if name not in ROLES:
        raise SystemExit(f"unknown role {name!r}")
    Path(args["out"]).write_text(json.dumps(role(name, args), default=str))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of CUDA state


if __name__ == "__main__":
    _main()
