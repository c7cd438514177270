"""The `ember` command line: version, doctor, and the archive and runtime commands."""

from __future__ import annotations

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

app = typer.Typer(help="ember: restore saved CUDA graphs instead of capturing them.", no_args_is_help=True)
console = Console()
bench = typer.Typer(help="Benchmarks (run the GPU ones on a GPU machine).", no_args_is_help=True)
app.add_typer(bench, name="bench")


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
bench.command("fetch")(importlib.import_module("ember_bench.fetch").bench_fetch)
bench.command("cb")(importlib.import_module("ember_bench.cb").bench_cb)
app.command("inspect")(importlib.import_module("ember.archive.commands").inspect)
app.command("verify")(importlib.import_module("ember.archive.commands").verify)
app.command("serve")(importlib.import_module("ember.serving.server").serve)
app.command("save")(importlib.import_module("ember.engines.decode.commands").save)
app.command("load")(importlib.import_module("ember.engines.decode.commands").load)
bench.command("graphs")(importlib.import_module("ember_bench.graphs").bench_graphs)
bench.command("claims")(importlib.import_module("ember_bench.claims").bench_claims)
bench.command("native")(importlib.import_module("ember_bench.native").bench_native)
