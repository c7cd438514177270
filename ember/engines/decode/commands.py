"""`ember save`, `ember load` and the GPU half of `ember verify --replay` (registered in ember.cli).

Both `save` and `load` re-execute themselves under libember (LD_PRELOAD, EMBER_MODE,
EMBER_ARM=manual) unless they already run that way. Job mode (`ember save --job`) is the SAVE Job
of every engine (`ember.engines.save_job`); this module holds the decode workloads' part of it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated, Any

import typer
from rich.console import Console

from ember import contract

console = Console(stderr=True)

WorkloadOpt = Annotated[
    str, typer.Option("--workload", "-w", help="Built-in workload, e.g. llama3-8b[-compile].")
]
LayersOpt = Annotated[int, typer.Option(help="Override the layer count (0 = the model's own).")]
SizesOpt = Annotated[str, typer.Option(help="Capture sizes: 'all' (67 engine defaults) or e.g. 1,2,8.")]
ConfigOpt = Annotated[
    str,
    typer.Option(
        "--model-config",
        help="A transformers config.json: its shape, random weights (--workload picks eager or '-compile').",
    ),
]
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        help="A local transformers checkpoint (config.json + *.safetensors): its shape and weights.",
    ),
]
StoreOpt = Annotated[
    str, typer.Option("--store", envvar=contract.ENV_STORE, help="Store URI (file:///... or s3://...).")
]


def _use_endpoint(endpoint: str) -> str:
    """--endpoint's callback: the store is opened further down (and in the process re-executed
    under libember), both read EMBER_S3_ENDPOINT."""
    if endpoint:
        os.environ["EMBER_S3_ENDPOINT"] = endpoint
    return endpoint


EndpointOpt = Annotated[str, typer.Option(
    "--endpoint", envvar="EMBER_S3_ENDPOINT", callback=_use_endpoint,
    help="S3 endpoint URL for an s3:// store (MinIO, on-prem).")]


TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel degree (dense workloads).")]
EpOpt = Annotated[int, typer.Option("--ep", help="Expert-parallel degree (MoE: = tp x dp).")]
DpOpt = Annotated[int, typer.Option("--dp", help="Data-parallel degree.")]
CollectivesOpt = Annotated[
    bool, typer.Option("--collectives", hidden=True, help="Collectives in a world of one (splice check).")
]
RankOpt = Annotated[int, typer.Option("--rank", envvar="RANK", help="This process's rank (LOAD).")]


def parallel_shape(tp: int, ep: int, dp: int, collectives: bool = False, rank: int = 0) -> Any:
    """The Parallel of the options; EP alone means a world of `ep` data-parallel ranks."""
    from ember.engines.decode.parallel import Parallel

    if ep > 1 and tp == 1 and dp == 1:
        dp = ep
    return Parallel(tensor=tp, expert=ep, data=dp, rank=rank, collectives=collectives)


def _identity_parallel(identity: Any) -> Any:
    """The Parallel an identity names (its revision's `-collectives` suffix: the splice check)."""
    p = identity.parallelism
    return parallel_shape(p.tensor, p.expert, p.data, identity.revision.endswith("-collectives"))


def parse_sizes(text: str) -> tuple[int, ...]:
    from ember.engines.decode.model import DEFAULT_SIZES

    if text in ("", "all"):
        return DEFAULT_SIZES
    sizes = tuple(sorted({int(s) for s in text.split(",") if s.strip()}))
    if not sizes or min(sizes) < 1:
        raise typer.BadParameter("sizes must be positive integers, e.g. 1,2,8")
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
            raise typer.BadParameter(f"--model-config {path}: not a causal-LM config ({exc})") from exc
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


def _workload_from_identity(identity: Any) -> tuple[Any, Any]:
    """The workload `identity_for` made `identity` from (its revision carries the layer count)."""
    name = identity.model.removeprefix("ember-workload/")
    if identity.compile and not name.endswith("-compile"):
        name += "-compile"
    layers = 0
    revision = identity.revision.removesuffix("-collectives")
    if revision.startswith("seed-") and "-layers-" in revision:
        layers = int(revision.rsplit("-", 1)[1])
    par = _identity_parallel(identity)
    return make_workload(name, layers, tuple(identity.capture_sizes), parallel=par), identity


def save_identity(identity: Any, store: str) -> dict[str, Any]:
    """The decode SAVE Job (`ember.engines.save_job`): the workload `identity` names, saved under
    that identity; a multi-GPU shape (or the one-GPU splice check) on ONE GPU under the NCCL stub.
    The process re-executes itself under libember first; its summary, or an exception."""
    from ember.runtime.session import reexec_under_libember

    reexec_under_libember("save", comm_stub=bool(_identity_parallel(identity).active))
    from ember.engines.decode.adapter import save_workload

    w, _ = _workload_from_identity(identity)
    return save_workload(w, store_uri=store, identity=identity, log=lambda m: console.print(m)).summary()


def save(
    ctx: typer.Context,
    workload: WorkloadOpt = "llama3-8b",
    layers: LayersOpt = 0,
    sizes: SizesOpt = "all",
    store: StoreOpt = "",
    model_config: ConfigOpt = "",
    model: ModelOpt = "",
    job: Annotated[bool, typer.Option("--job", help="The SAVE Job (EMBER_IDENTITY, EMBER_STORE).")] = False,
    prove_only: Annotated[bool, typer.Option("--prove-only", help="Prove only, publish nothing.")] = False,
    tpot: Annotated[
        str, typer.Option(help="Also time the captured graphs' decode step at these batch sizes (1,64).")
    ] = "",
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    dp: DpOpt = 1,
    collectives: CollectivesOpt = False,
    endpoint: EndpointOpt = "",
) -> None:
    """SAVE: capture a workload's decode graphs, prove them bit-exact, publish the archive. A
    multi-GPU shape (--tp/--ep/--dp) is saved on ONE GPU: every rank LOADs the same archive.
    `--job`: the operator's SAVE Job, for the engine EMBER_IDENTITY names (`ember.engines.save_job`;
    vLLM takes the arguments after `--`)."""
    if job:  # the operator's SAVE Job, for the engine its identity names
        from ember.engines import save_job

        raise typer.Exit(save_job.run(store, list(ctx.args), log=lambda m: console.print(f"[red]{m}[/red]")))
    if ctx.args:
        raise typer.BadParameter(f"unexpected arguments {ctx.args} (only a vLLM SAVE Job takes any)")
    from ember.runtime.session import reexec_under_libember

    par = parallel_shape(tp, ep, dp, collectives)
    reexec_under_libember("save", comm_stub=bool(par.active))
    from ember.engines.decode.adapter import save_workload

    try:
        w = make_workload(workload, layers, parse_sizes(sizes), model_config or None, model or None, par)
        if not store and not prove_only:
            raise RuntimeError("no store: pass --store or set EMBER_STORE (or use --prove-only)")
        out = save_workload(
            w,
            store_uri=None if prove_only else store,
            tpot_batches=tuple(int(b) for b in tpot.split(",") if b.strip()),
            log=lambda m: console.print(m),
        )
    except Exception as exc:
        console.print(f"[red]SAVE failed: {type(exc).__name__}: {exc}[/red]")
        raise typer.Exit(1) from exc
    print(json.dumps(out.summary(), indent=1))


def load(
    workload: WorkloadOpt = "llama3-8b",
    layers: LayersOpt = 0,
    sizes: SizesOpt = "all",
    store: StoreOpt = "",
    model_config: ConfigOpt = "",
    model: ModelOpt = "",
    identity: Annotated[str, typer.Option(help="Identity hash (default: derived from the workload).")] = "",
    batch: Annotated[int, typer.Option(help="Batch size of the proving decode.")] = 8,
    verify: Annotated[
        bool, typer.Option(help="Also replay every graph and compare with SAVE's outputs.")
    ] = False,
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    dp: DpOpt = 1,
    collectives: CollectivesOpt = False,
    rank: RankOpt = 0,
    endpoint: EndpointOpt = "",
) -> None:
    """LOAD an archive in this fresh process, then decode greedily to prove it (tokens vs SAVE's).
    One process per rank for a multi-GPU shape (--rank, MASTER_ADDR/MASTER_PORT as torchrun)."""
    from ember.runtime.session import reexec_under_libember
    reexec_under_libember("load")
    from ember.engines.decode.adapter import identity_for, load_workload
    from ember.handoff import load_attempt
    from ember.runtime.adapter import Refused
    from ember.runtime.proof.replay import decode_tokens

    par = parallel_shape(tp, ep, dp, collectives, rank)
    ident = (
        identity
        or identity_for(
            make_workload(workload, layers, parse_sizes(sizes), model_config or None, model or None, par)
        ).hash()
    )
    try:
        loaded = load_workload(
            store, ident, log=lambda m: console.print(m), model_dir=model or None, parallel=par
        )
    except Refused as exc:
        console.print(f"[yellow]LOAD refused, capture natively: {exc.reason}[/yellow]")
        raise typer.Exit(3) from exc
    w = loaded.workload
    with load_attempt(identity=ident):  # EMBER_RUN_DIR, else the pod contract's run dir
        sha, first = decode_tokens(w, loaded.launch, batch)
    want = loaded.archive.engine.get("decode_sha256", {}).get(str(batch))
    result: dict[str, Any] = {
        "identity": ident,
        "timings": loaded.timings,
        "batch": batch,
        "tokens_sha256": sha,
        "tokens_identical": (sha == want) if want else None,
        "first_tokens": first,
    }
    if verify:
        result["replay"] = replay_verify_loaded(loaded)
    print(json.dumps(result, indent=1))
    ok = result["tokens_identical"] is not False and result.get("replay", {}).get("ok", True)
    raise typer.Exit(0 if ok else 1)


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
        loaded = load_workload(store_uri, identity_hash, log=lambda m: console.print(m))
    except Refused as exc:
        return {"ok": False, "refused": exc.reason}
    return replay_verify_loaded(loaded)


def verify_replay_cmd(
    store: StoreOpt = "",
    model_config: ConfigOpt = "",
    identity: Annotated[str, typer.Argument(help="Identity hash of the archive.")] = "",
) -> None:
    """GPU: LOAD the archive and replay every graph, comparing outputs bitwise with SAVE's."""
    from ember.runtime.session import reexec_under_libember

    reexec_under_libember("load")
    res = replay_verify(store, identity)
    print(json.dumps(res, indent=1))
    sys.exit(0 if res.get("ok") else 1)
