"""The `ember` command line, the composition root: it may import every layer of the core.

Core commands: version, doctor, inspect and verify (archives.py, no GPU), ls and gc (store.py),
save and load (decode.py; `save --job` is every engine's SAVE Job, ember.cli.save_job), serve
(declared in ember.serving.options; the server is ember.serving.server). `verify --replay` is
composed here: the archive's integrity checks, then the runtime's GPU replay. Other packages add
command groups through the `ember.commands` entry-point group (`ember bench` comes from the
benchmarks that way), so the core never imports them. Every module imported here keeps torch out
of its module level: `ember --help` stays cheap.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

import ember
from ember.cli import archives as archive_commands
from ember.cli import store as store_commands
from ember.cli.decode import load, save
from ember.engines.decode.workloads import replay_verify
from ember.serving.options import CONTEXT_SETTINGS as SERVE_SETTINGS
from ember.serving.options import serve

app = typer.Typer(help="ember: restore saved CUDA graphs instead of capturing them.", no_args_is_help=True)
console = Console()
err_console = Console(stderr=True)


@app.command()
def version() -> None:
    """Print ember's version."""
    console.print(f"ember {ember.__version__}")


def _gpu_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {}
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        facts["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        facts["gpus"] = []
    if importlib.util.find_spec("torch") is not None:
        import torch

        facts["torch"] = torch.__version__
        facts["torch_cuda"] = torch.version.cuda or ""
        facts["cuda_available"] = bool(torch.cuda.is_available())
    return facts


def doctor_report() -> dict[str, Any]:
    """What this machine has, and whether ember can run here."""
    from ember import native

    report: dict[str, Any] = {
        "ember": ember.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    lib = native.find_library()
    report["native_library"] = str(lib) if lib else None
    try:
        native.load_library(lib)
        report["native_loadable"] = True
    except (OSError, FileNotFoundError) as exc:
        report["native_loadable"] = False
        report["native_error"] = str(exc)
    report["components"] = {
        name: importlib.util.find_spec(mod) is not None
        for name, mod in {
            "operator (kopf)": "kopf",
            "kubernetes client": "kubernetes",
            "s3 (boto3)": "boto3",
            "metrics (prometheus-client)": "prometheus_client",
            "cuda bindings": "cuda.bindings" if importlib.util.find_spec("cuda") else "cuda",
            "torch": "torch",
            "transformers": "transformers",
        }.items()
    }
    report.update(_gpu_facts())
    report["preloaded"] = "libember" in os.environ.get("LD_PRELOAD", "")
    from ember import settings

    report["settings changed"] = [f"{k}={v}" for k, v in settings.changed().items()]  # EMBER_* knobs
    report["healthy"] = bool(report["native_loadable"])
    return report


@app.command()
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check this machine: Python, torch/CUDA/driver/GPU, the native library, optional parts.

    Exit code 0 when ember can run here (the native library loads), 1 otherwise.
    """
    report = doctor_report()
    if as_json:
        console.print_json(json.dumps(report))
    else:
        table = Table(title="ember doctor", show_header=False)
        for key, value in report.items():
            if isinstance(value, dict):
                value = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in value.items())
            elif isinstance(value, list):
                value = "; ".join(value) or "none"
            table.add_row(key, str(value))
        console.print(table)
    raise typer.Exit(0 if report["healthy"] else 1)


def replay_problems(store_uri: str, identity_hash: str) -> list[str]:
    """GPU replay of every graph, compared bitwise with SAVE's outputs, as problem sentences."""
    try:
        res = replay_verify(store_uri, identity_hash)
    except Exception as exc:  # no GPU, no libember, driver errors: a problem to report, not a crash
        return [f"GPU replay failed: {type(exc).__name__}: {exc}"]
    if res.get("ok"):
        return []
    if "refused" in res:
        return [f"LOAD refused the archive on this machine: {res['refused']}"]
    differ = res.get("differ", [])
    return [f"{len(differ)} of {res.get('graphs', 0)} graph(s) replayed differently from SAVE "
            f"(first keys: {differ[:5]})" if differ else f"replay checked no graph: {res}"]


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def _reexec_for_replay() -> None:
    try:
        # imported here: the session module loads the CUDA bindings, which `ember --help` need not
        from ember.runtime.session import reexec_under_libember

        reexec_under_libember("load")
    except Exception as exc:  # replay_problems then reports why replay cannot run here
        err_console.print(f"[yellow]cannot run under libember here:[/yellow] {exc}")


def verify(
    store_uri: archive_commands.StoreArg,
    identity_hash: archive_commands.HashArg = None,
    expect_identity: archive_commands.ExpectIdentityOpt = None,
    replay: Annotated[bool, typer.Option("--replay", help="Also replay every graph on this GPU vs native.")]
    = False,
    as_json: archive_commands.JsonOpt = False,
    trusted_key: archive_commands.TrustedKeyOpt = None,
    endpoint: archive_commands.EndpointOpt = None,
) -> None:
    """Check an archive's integrity without a GPU: signature (verified with --trusted-key, else
    reported: unsigned or by whom), manifest, identity, every blob's size and digest,
    decompression, the graph table's structure. A store of several archives and no hash: each is
    verified, a line each. A hash may be a unique prefix (≥ 8 hex). Exit 0 = intact, 1 = problems,
    2 = store unreachable (or --replay without torch).
    """
    if replay and not _has_torch():
        err_console.print("[red]verify --replay needs torch and a CUDA GPU[/red] (it replays every graph "
                          "through the runtime): install ember with torch on a GPU machine, or run "
                          "`ember verify` without --replay for the integrity checks")
        raise typer.Exit(2)
    if replay:
        _reexec_for_replay()  # LOAD must run under libember: this process is replaced once
    archive_commands.verify_and_report(store_uri, identity_hash, expect_identity, as_json,
                                       more=replay_problems if replay else None, trusted_keys=trusted_key,
                                       endpoint=endpoint)


app.command("inspect")(archive_commands.inspect)
app.command("ls")(store_commands.ls)
app.command("gc")(store_commands.gc)
app.command("verify")(verify)
app.command("serve", context_settings=SERVE_SETTINGS)(serve)
app.command("save", context_settings={"allow_extra_args": True})(save)  # `--job -- <engine args>`
app.command("load")(load)

# Command groups of other installed packages (pyproject.toml [project.entry-points."ember.commands"]).
for _plugin in importlib.metadata.entry_points(group="ember.commands"):
    app.add_typer(_plugin.load(), name=_plugin.name)
