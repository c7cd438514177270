"""`ember save`, `ember load` and `ember verify --replay`'s GPU half as commands (ember.cli); the
workloads they name are `ember.engines.decode.workloads`.

Both `save` and `load` re-execute themselves under libember (LD_PRELOAD, EMBER_MODE,
EMBER_ARM=manual) unless they already run that way. Job mode (`ember save --job`) is the SAVE Job
of every engine (`ember.cli.save_job`).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated, Any

import typer
from rich.console import Console

from ember import contract
from ember.engines.decode import workloads
from ember.engines.decode.workloads import parallel_shape, replay_verify, replay_verify_loaded

console = Console(stderr=True)


def make_workload(name: str, layers: int, sizes: str, model_config: str | None = None,
                  model_dir: str | None = None, parallel: Any = None) -> Any:
    """The options' workload; a bad option is a usage error (exit 2)."""
    try:
        shape = workloads.parse_sizes(sizes)
        return workloads.make_workload(name, layers, shape, model_config, model_dir, parallel)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc

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
    `--job`: the operator's SAVE Job, for the engine EMBER_IDENTITY names (`ember.cli.save_job`;
    the engine's arguments after `--`)."""
    if job:  # the operator's SAVE Job, for the engine its identity names
        from ember.cli import save_job

        raise typer.Exit(save_job.run(store, list(ctx.args), log=lambda m: console.print(f"[red]{m}[/red]")))
    if ctx.args:
        raise typer.BadParameter(f"unexpected arguments {ctx.args} (only a SAVE Job, --job, takes any)")
    from ember.runtime.session import reexec_under_libember

    par = parallel_shape(tp, ep, dp, collectives)
    reexec_under_libember("save", comm_stub=bool(par.active))
    from ember.engines.decode.adapter import save_workload

    try:
        w = make_workload(workload, layers, sizes, model_config or None, model or None, par)
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
            make_workload(workload, layers, sizes, model_config or None, model or None, par)
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
