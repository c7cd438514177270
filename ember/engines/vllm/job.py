"""The SAVE Job of a vLLM deployment: `ember save --job` when EMBER_IDENTITY's engine is vllm.

Same contract as every SAVE Job (ember/contract.py): identity from EMBER_IDENTITY, store from
EMBER_STORE, a JSON summary in the termination log, a non-zero exit with the reason. On ONE GPU,
in two child processes, each a vLLM engine with its core in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that ember's plugin runs where this job can read its report:

1. sizing, unless the deployment's arguments fix `--kv-cache-memory-bytes`: vLLM as it is (no
   libember) until memory profiling has returned the KV-cache bytes, then the process ends
   (`EMBER_VLLM_PROBE`). SAVE cannot profile: profiling allocates, and LOAD, which skips it, must
   allocate as SAVE did. The probe's compile fills the compile cache, so step 2 compiles warm;
2. SAVE: vLLM under libember (EMBER_MODE=save) with those bytes; the plugin captures every key
   once inside the capture window, proves the graphs, and publishes them under the operator's
   identity with the compile cache attached. `VllmAdapter.identity` refuses a vLLM whose resolved
   config is not that identity, so the archive a deployment names holds the graphs its pods ask for.

vLLM runs with `ember.engines.vllm.args.engine_args(identity)` and then the deployment's own
`engine.args` (the pods get the same list through the claim). A multi-GPU shape (tensor x data
ranks) is saved on the same ONE GPU: both children play rank `EMBER_VLLM_SAVE_RANK` (default 0)
of the world under libember_nccl (`ember.engines.vllm.ranks`) and the Job reads that rank's report
file. A shape it cannot play is refused with its reason: the GraphArchive fails and the pods
capture natively, as with any failed SAVE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ember import contract
from ember.engines.vllm import ranks
from ember.engines.vllm import report as reports
from ember.engines.vllm.args import engine_args, process_env
from ember.identity import ArchiveIdentity

KV_FLAG = "--kv-cache-memory-bytes"


class JobFailed(RuntimeError):
    pass


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _child_env(mode: str, report: Path, store_uri: str, identity_raw: str) -> dict[str, str]:
    identity = ArchiveIdentity.model_validate_json(identity_raw)
    parallel = ranks.is_parallel(identity)
    env = process_env(mode, os.environ, comm_stub=parallel)
    if parallel:
        from ember.runtime.comm import stub_path

        env.update(ranks.save_env(identity, ranks.save_rank(os.environ), str(stub_path())))
    # SAVE publishes under the identity it is given, whatever the Job's own environment holds
    save = {"EMBER_VLLM_STORE": store_uri, contract.ENV_IDENTITY: identity_raw}
    env.update(save if mode == "save" else {"EMBER_VLLM_PROBE": "1"})
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", EMBER_VLLM_REPORT=str(report), PYTHONUNBUFFERED="1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return env


def run_child(mode: str, args: list[str], work: Path, store_uri: str, identity_raw: str, *,
              python: str, timeout: float) -> dict[str, Any]:
    """One vLLM engine start (`python -m ember.engines.vllm.job <args>`); the plugin's report."""
    report, logf = work / f"{mode}.report.json", work / f"{mode}.log"
    reports.clear(report)
    t = time.perf_counter()
    with open(logf, "w") as log:
        try:
            proc = subprocess.run([python, "-m", "ember.engines.vllm.job", json.dumps(args)],
                                  env=_child_env(mode, report, store_uri, identity_raw), stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout, check=False)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout:.0f} s"
    out = rank_report(report, ranks.save_rank(os.environ))
    out.update(rc=rc, seconds=round(time.perf_counter() - t, 2))
    if rc != 0:
        out["log_tail"] = logf.read_text(errors="replace")[-3000:]
    return out


def rank_report(path: Path, rank: int) -> dict[str, Any]:
    """The child's report as `rank` saw it: the file the process wrote before torch.distributed
    was up, then that rank's own file (`vllm-report.rank<r>.json`) over it, never another rank's."""
    merged = reports.read(path)
    mine = (merged.pop("ranks", None) or {}).get(str(rank)) or {}
    stages = {**(merged.get("stages") or {}), **(mine.get("stages") or {})}
    merged.update({k: v for k, v in mine.items() if k != "stages"})
    if stages:
        merged["stages"] = stages
    return merged


def _stage(report: dict[str, Any], name: str) -> dict[str, Any]:
    return dict((report.get("stages") or {}).get(name) or {})


def _why(step: str, res: dict[str, Any]) -> str:
    for stage in ("refused", "save_refused", "load_refused"):
        if reason := _stage(res, stage).get("reason"):
            return f"{step}: {reason}"
    tail = " | ".join(line for line in str(res.get("log_tail", "")).splitlines()[-3:] if line.strip())
    return f"{step}: the vLLM process ended with {res.get('rc')}" + (f" ({tail})" if tail else "")


def save_job(identity_raw: str, store_uri: str, extra_args: list[str], *, work: Path | None = None,
             python: str = sys.executable, timeout: float = 3600.0) -> dict[str, Any]:
    """Size, then SAVE; the summary the Job reports. JobFailed with the reason otherwise."""
    identity = ArchiveIdentity.model_validate_json(identity_raw)
    if ranks.is_parallel(identity):
        try:
            why = ranks.refusals(identity, ranks.save_rank(os.environ))
        except ValueError as exc:
            why = [str(exc)]
        if why:
            raise JobFailed(f"vLLM SAVE of {identity.parallelism}: " + "; ".join(why))
    work = work or Path(tempfile.mkdtemp(prefix="ember-vllm-job-"))
    work.mkdir(parents=True, exist_ok=True)
    pins = ranks.is_parallel(identity)
    args = [*engine_args(identity, rank_pins=pins), *ranks.save_args(identity), *extra_args]
    summary: dict[str, Any] = {"engine": "vllm", "args": args}
    if ranks.is_parallel(identity):
        summary.update(rank=ranks.save_rank(os.environ), world=ranks.world(identity))
    steps: dict[str, float] = {}
    if not _has_flag(args, KV_FLAG):
        probe = run_child("probe", args, work, store_uri, identity_raw, python=python, timeout=timeout)
        kv = _stage(probe, "worker.determine_available_memory").get("bytes")
        if not kv:
            raise JobFailed(_why("sizing (native start up to memory profiling)", probe))
        args += [KV_FLAG, str(int(kv))]
        steps["probe_process_s"] = probe["seconds"]
    res = run_child("save", args, work, store_uri, identity_raw, python=python, timeout=timeout)
    saved = _stage(res, "save")
    if res["rc"] != 0 or not saved.get("published"):
        raise JobFailed(_why("SAVE", res))
    if saved.get("identity") != identity.hash():
        raise JobFailed(f"SAVE published {saved.get('identity')}, not the Job's identity {identity.hash()}")
    summary.update({k: v for k, v in saved.items() if k not in ("t", "seconds")})
    steps["save_process_s"] = res["seconds"]
    summary["durations"] = {**(saved.get("durations") or {}), **steps}
    return summary


def llm_from_cli(args: list[str]) -> Any:
    """A vLLM `LLM` built from command-line engine arguments (vLLM's own parser). Arguments that
    are not engine arguments (`vllm serve`'s front-end options) are ignored, and said so."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ns, unknown = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_known_args(args)
    if unknown:
        print(f"ember: not engine arguments, ignored: {unknown}", flush=True)
    return LLM.from_engine_args(EngineArgs.from_cli_args(ns))


if __name__ == "__main__":  # one step of the Job: the plugin does the work while the engine starts
    ranks.enter()  # a parallel shape: this process becomes one rank of the world first
    llm_from_cli(json.loads(sys.argv[1]))
