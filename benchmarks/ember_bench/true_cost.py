"""LOAD's true cost, two ways (`ember bench graphs` runs it after its own LOAD child).

`load_ms` counts LOAD's critical path only: the reconstruction (blob reads, table decode,
kernel lookup, templates) runs on a background thread while the model builds, where it can slow
the build. These figures count everything the user waits for:

- warm: a warm pod — the model is built, then the archive comes. Wall time from opening the
  archive until the first (smallest) key is launchable (`warm_first_ms`), until every key has
  launched once (`warm_all_ms`: each key's graph built, the template updated to it), and until
  the dedicated execs those launches asked for are ready too (`warm_settled_ms`; a key launched
  through an updated template asks for its own exec, `ember.runtime.graphs.templates`).
- cold: a pod that starts with its archive. (a process that builds the model AND restores, until
  every key has launched once) minus (a process that only builds the same model, restoring
  nothing), both under libember in load mode, both timed from the armed session on.

Each in its own fresh process, `repeats` times; the report keeps every run and the medians.
Children: `python -m ember_bench.true_cost ROLE ARGS_JSON`.
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
from typing import Any

ROLES = ("warm", "cold", "build")


def _facts(store: str, identity: str) -> dict[str, Any]:
    from ember.runtime import publish

    return dict(publish.open_archive(store, identity).manifest.engine)


def _build(facts: dict[str, Any]) -> Any:
    import torch

    from ember.engines.decode.model import DecodeWorkload

    w = DecodeWorkload.from_config(facts)
    w.build(kv_cache_bytes=int(facts["kv_cache_bytes"]), compile_fn=False)
    torch.cuda.synchronize()
    return w


def _launch_all(loaded: Any, t0: float, out: dict[str, Any], prefix: str) -> None:
    """First key launchable, every key launched once, every dedicated exec ready (ms from t0)."""
    import torch

    lib = loaded.library
    keys = sorted(tuple(k) for k in lib.keys)
    loaded.launch(keys[0])
    torch.cuda.synchronize()
    out[f"{prefix}_first_ms"] = (time.perf_counter() - t0) * 1e3
    for k in keys[1:]:
        loaded.launch(k)
    torch.cuda.synchronize()
    out[f"{prefix}_all_ms"] = (time.perf_counter() - t0) * 1e3
    lib.settle()
    out[f"{prefix}_settled_ms"] = (time.perf_counter() - t0) * 1e3


def role(name: str, args: dict[str, Any]) -> dict[str, Any]:
    from ember.engines.decode.adapter import load_workload
    from ember.runtime.session import native_session

    ip = native_session("load")  # armed before anything is built, as in a pod
    out: dict[str, Any] = {"role": name}
    if name == "build":
        facts = _facts(args["store"], args["identity"])
        t0 = time.perf_counter()
        _build(facts)
        out["build_ms"] = (time.perf_counter() - t0) * 1e3
    elif name == "warm":
        prebuilt = _build(_facts(args["store"], args["identity"]))
        t0 = time.perf_counter()
        loaded = load_workload(
            args["store"], args["identity"], interposer=ip, prebuilt=prebuilt, log=lambda m: None
        )
        _launch_all(loaded, t0, out, "warm")
        out["warm_load_timings"] = loaded.timings
    else:  # cold: the manifest read, the build and the LOAD all inside the timed span
        t0 = time.perf_counter()
        loaded = load_workload(args["store"], args["identity"], interposer=ip, log=lambda m: None)
        _launch_all(loaded, t0, out, "cold")
        out["cold_build_ms"] = loaded.timings["build_workload_ms"]
    return out


def _run(name: str, args: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
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
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in ROLES}
    for _ in range(repeats):
        for name in ROLES:
            runs[name].append(_run(name, args, env, timeout))
    errors = [r for rs in runs.values() for r in rs if "error" in r]
    out: dict[str, Any] = {"runs": runs, "repeats": repeats}
    if errors:
        out["error"] = errors[0]
        return out

    def med(role_name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[role_name])

    for key in (
        "warm_first_ms",
        "warm_all_ms",
        "warm_settled_ms",
        "cold_first_ms",
        "cold_all_ms",
        "cold_settled_ms",
    ):
        out[key] = med(key.split("_")[0], key)
    out["build_only_ms"] = med("build", "build_ms")
    out["cold_extra_ms"] = out["cold_all_ms"] - out["build_only_ms"]  # restoring's cost over a bare build
    out["cold_extra_settled_ms"] = out["cold_settled_ms"] - out["build_only_ms"]
    return out


def _main() -> None:
    name, args = sys.argv[1], json.loads(sys.argv[2])
    if name not in ROLES:
        raise SystemExit(f"unknown role {name!r}")
    Path(args["out"]).write_text(json.dumps(role(name, args), default=str))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of CUDA state


if __name__ == "__main__":
    _main()
