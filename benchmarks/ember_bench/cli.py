"""`ember bench ...`: the benchmark commands, plugged into the `ember` command through the
`ember.commands` entry-point group (pyproject.toml), so the core package never imports this one.

Every benchmark module imports torch, the sidecar or the operator inside its functions: loading
this app (what `ember --help` does) stays cheap and works on a machine without a GPU.
"""

from __future__ import annotations

import typer

from ember_bench.cb import bench_cb
from ember_bench.cb_warm import bench_cb_warm
from ember_bench.claims import bench_claims
from ember_bench.correctness import bench_correctness
from ember_bench.fetch import bench_fetch
from ember_bench.fuzz import bench_fuzz
from ember_bench.graphs import bench_graphs
from ember_bench.native import bench_native
from ember_bench.parse import bench_parse
from ember_bench.switch import bench_switch
from ember_bench.vllm import bench_vllm
from ember_bench.vllm_switch import bench_vllm_switch
from ember_bench.vllm_warm import bench_vllm_warm

app = typer.Typer(help="Benchmarks (run the GPU ones on a GPU machine).", no_args_is_help=True)
app.command("graphs")(bench_graphs)
app.command("cb")(bench_cb)
app.command("cb-warm")(bench_cb_warm)
app.command("fetch")(bench_fetch)
app.command("claims")(bench_claims)
app.command("native")(bench_native)
app.command("parse")(bench_parse)
app.command("switch")(bench_switch)
app.command("fuzz")(bench_fuzz)
app.command("vllm")(bench_vllm)
app.command("vllm-warm")(bench_vllm_warm)
app.command("vllm-switch")(bench_vllm_switch)
app.command("correctness")(bench_correctness)
