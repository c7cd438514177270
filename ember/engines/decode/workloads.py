"""ember's built-in decode workloads as the commands and the SAVE Job name them: a workload from
its name, a transformers config or a local checkpoint, its parallel shape, the workload an
archive identity names (`identity_for`'s inverse), and the GPU half of `ember verify --replay`.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parallel_shape(tp: int, ep: int, dp: int, collectives: bool = False, rank: int = 0) -> Any:
    """The Parallel of the options; EP alone means a world of `ep` data-parallel ranks."""
    from ember.engines.decode.parallel import Parallel

    if ep > 1 and tp == 1 and dp == 1:
        dp = ep
    return Parallel(tensor=tp, expert=ep, data=dp, rank=rank, collectives=collectives)


def identity_parallel(identity: Any) -> Any:
    """The Parallel an identity names (`collectives` in its workload settings: the splice check)."""
    p = identity.parallelism
    return parallel_shape(p.tensor, p.expert, p.data, identity.workload.get("collectives") == "true")


def parse_sizes(text: str) -> tuple[int, ...]:
    from ember.engines.decode.model import DEFAULT_SIZES

    if text in ("", "all"):
        return DEFAULT_SIZES
    sizes = tuple(sorted({int(s) for s in text.split(",") if s.strip()}))
    if not sizes or min(sizes) < 1:
        raise ValueError("sizes must be positive integers, e.g. 1,2,8")
    return sizes


def make_workload(
    name: str,
    layers: int,
    sizes: tuple[int, ...],
    model_config: str | None = None,
    model_dir: str | None = None,
    parallel: Any = None,
) -> Any:
    """A built-in workload by name, or (with `model_config`) a transformers config.json's shape
    with random weights, or (with `model_dir`) a local checkpoint's shape and weights."""
    from dataclasses import replace
    from pathlib import Path

    from ember.engines.decode.model import DecodeWorkload, spec_from_hf_config

    if model_dir:
        model_config = str(Path(model_dir) / "config.json")
    if model_config:
        path = Path(model_config)
        try:
            spec = spec_from_hf_config(json.loads(path.read_text()), name=path.parent.name or path.stem)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"--model-config {path}: not a causal-LM config ({exc})") from exc
        if layers:
            spec = replace(spec, layers=layers)
        compiled = name.endswith("-compile")
        kind = "checkpoint" if model_dir else "config"
        return DecodeWorkload(
            spec,
            compiled=compiled,
            sizes=sizes,
            name=f"{kind}-{spec.name}" + ("-compile" if compiled else ""),
            weights=str(Path(model_dir).absolute()) if model_dir else None,
            **({"parallel": parallel} if parallel is not None else {}),
        )
    extra = {"parallel": parallel} if parallel is not None else {}
    return DecodeWorkload.from_name(name, layers=layers or None, sizes=sizes, **extra)


def workload_from_identity(identity: Any) -> tuple[Any, Any]:
    """The workload `identity_for` made `identity` from (its workload settings: layers, ...)."""
    name = identity.model.removeprefix("ember-workload/")
    if identity.compile and not name.endswith("-compile"):
        name += "-compile"
    layers = int(identity.workload.get("layers", 0))
    par = identity_parallel(identity)
    return make_workload(name, layers, tuple(identity.capture_sizes), parallel=par), identity


def save_identity(identity: Any, store: str) -> dict[str, Any]:
    """The decode SAVE Job (`ember.cli.save_job`): the workload `identity` names, saved under
    that identity; a multi-GPU shape (or the one-GPU splice check) on ONE GPU under the NCCL stub.
    The process re-executes itself under libember first; its summary, or an exception."""
    from ember.runtime.session import reexec_under_libember

    reexec_under_libember("save", comm_stub=bool(identity_parallel(identity).active))
    from ember.engines.decode.adapter import save_workload

    w, _ = workload_from_identity(identity)
    return save_workload(w, store_uri=store, identity=identity, log=_log).summary()


def replay_verify_loaded(loaded: Any) -> dict[str, Any]:
    """Replay every restored graph in SAVE's order and compare output fingerprints bitwise."""
    from ember.runtime.proof.replay import replay_fingerprints

    w, lib = loaded.workload, loaded.library
    keys = [tuple(k) for k in lib.keys]
    got = replay_fingerprints(w, loaded.launch, keys, lambda k: loaded.outputs[k])
    want = loaded.archive.engine.get("fingerprints", {})
    bad = [k for k in got if want.get(k) != got[k]]
    return {
        "graphs": len(got),
        "identical": len(got) - len(bad),
        "differ": bad[:10],
        # which outputs (by position) differ, e.g. logits only while the tokens agree
        "differ_outputs": {
            k: [j for j, (a, b) in enumerate(zip(got[k], want.get(k) or [], strict=False)) if a != b]
            for k in bad[:10]
        },
        "ok": not bad and bool(got),
    }


def replay_verify(store_uri: str, identity_hash: str) -> dict[str, Any]:
    """GPU half of `ember verify --replay`: LOAD here (needs libember in load mode) and replay all.

    Returns {"ok": bool, "graphs": n, "identical": n, "differ": [...]} or {"ok": False, "refused": reason}.
    """
    from ember.engines.decode.adapter import load_workload
    from ember.runtime.adapter import Refused

    try:
        loaded = load_workload(store_uri, identity_hash, log=_log)
    except Refused as exc:
        return {"ok": False, "refused": exc.reason}
    return replay_verify_loaded(loaded)
