"""`ember bench switch`: parallelism switches by CR edit on the local control plane (kwok).

The operator runs as a subprocess watching a fresh namespace (`claims._Bench`); the archives of
both shapes are pre-written into its local store (as the low-priority presave Jobs would have
written them). One ModelDeployment of `replicas` pods alternates between two shapes, A = DP1
(one GPU per pod) and B = DP2/EP2 (two GPUs), both listed in `spec.parallelism.alternatives`,
with a warm pool of `warm` GPUs (split over the two GPU counts).

Per switch: time from the CR edit to every pod of the new shape being Ready with its claim naming
the archive (`ember.dev/archive` set: restored, not captured), and how many of them came from
the warm pool. Before the next switch the old pods are gone and the pool is full again. Next to
it, the same pods created from scratch: a fresh ModelDeployment of shape B with the archive
present and no warm pool, from create to every pod Ready. kwok makes pods Ready without running
them, so both figures are the control-plane part of a switch (claim or create → scheduled →
Ready), the floor under what a GPU cluster adds (engine start, LOAD).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from ember import contract
from ember_bench.claims import MD, REPO, _Bench, _percentile, operator_bench

console = Console()
SHAPE_A = {"tensor": 1, "expert": 1, "data": 1}
SHAPE_B = {"tensor": 1, "expert": 2, "data": 2}


def _shape_of(pod: Any) -> tuple[int, int, int] | None:
    try:
        par = json.loads(pod.metadata.annotations[contract.ANN_IDENTITY_SPEC])["parallelism"]
    except (KeyError, TypeError, ValueError):
        return None
    return par["tensor"], par["expert"], par["data"]


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def _key(shape: dict[str, int]) -> tuple[int, int, int]:
    return shape["tensor"], shape["expert"], shape["data"]


class _Switches:
    def __init__(self, bench: _Bench, replicas: int, warm: int) -> None:
        self.bench, self.replicas, self.warm = bench, replicas, warm

    def spec(
        self, shape: dict[str, int], warm: int, alternatives: bool = True, tag: str = "bench",
    ) -> dict[str, Any]:
        spec = self.bench.spec("Qwen/Qwen3-0.6B", self.replicas, warm, image_tag=tag)
        spec["parallelism"] = {**shape, "alternatives": [SHAPE_A, SHAPE_B] if alternatives else []}
        spec["drainSeconds"] = 1
        return spec

    def serving(self, name: str) -> list[Any]:
        selector = f"{contract.LABEL_DEPLOYMENT}={name},{contract.LABEL_POOL}={contract.POOL_SERVING}"
        return self.bench.pods(selector)

    def new_ready(self, name: str, shape: dict[str, int]) -> list[Any] | None:
        pods = [p for p in self.serving(name) if _shape_of(p) == _key(shape)
                and _ready(p) and (p.metadata.annotations or {}).get(contract.ANN_ARCHIVE)]
        return pods if len(pods) >= self.replicas else None

    def settled(self, name: str, shape: dict[str, int]) -> bool:
        b = self.bench
        md: Any = b.custom.get_namespaced_custom_object(*MD, b.ns, contract.MODEL_DEPLOYMENTS, name)
        st = md.get("status") or {}
        warm = [p for p in self.bench.pods(f"{contract.LABEL_POOL}={contract.POOL_WARM}") if _ready(p)]
        draining = self.bench.pods(f"{contract.LABEL_DEPLOYMENT}={name},{contract.LABEL_POOL}=draining")
        return (st.get("phase") == "Ready" and not st.get("switch") and not draining
                and st.get("observedGeneration") == md["metadata"]["generation"]
                and self.new_ready(name, shape) is not None and len(warm) >= self.expected_warm)

    @property
    def expected_warm(self) -> int:
        from ember_operator.api import ModelDeploymentSpec
        from ember_operator.pools import warm_split

        return sum(warm_split(ModelDeploymentSpec.model_validate(self.spec(SHAPE_A, self.warm))).values())

    def warm_expected(self, shape: dict[str, int]) -> int:
        """The new pods a switch to `shape` should take warm: its replicas, up to the warm pods of
        its GPU count (`warm_split`)."""
        from ember_operator.api import ModelDeploymentSpec
        from ember_operator.pools import warm_split

        spec = ModelDeploymentSpec.model_validate(self.spec(shape, self.warm))
        return min(self.replicas, warm_split(spec).get(spec.parallelism.shapes()[0].gpus, 0))

    def switches(self, count: int) -> dict[str, Any]:
        b = self.bench
        name = "switch"
        for shape in (SHAPE_A, SHAPE_B):
            b.write_archive(self.spec(shape, 0, alternatives=False))
        b.create_md(name, self.spec(SHAPE_A, self.warm))
        b.wait(lambda: self.settled(name, SHAPE_A), "first Ready with a full warm pool", 180)
        runs = []
        for i in range(count):
            target = SHAPE_B if i % 2 == 0 else SHAPE_A
            t0 = time.perf_counter()
            b.custom.patch_namespaced_custom_object(*MD, b.ns, contract.MODEL_DEPLOYMENTS, name,
                                                    {"spec": {"parallelism": target}})
            pods = b.wait(lambda t=target: self.new_ready(name, t), f"switch {i}: new pods Ready", 120, 0.02)
            took = time.perf_counter() - t0
            warm = sum(p.metadata.name.startswith("ember-warm-") for p in pods)
            runs.append({"to": _key(target), "seconds": took, "from_warm": warm, "pods": len(pods),
                         "warm_expected": self.warm_expected(target)})
            console.print(f"switch {i + 1}/{count} → {_key(target)}: {took * 1000:.0f} ms "
                          f"({warm}/{len(pods)} warm)")
            b.wait(lambda t=target: self.settled(name, t), f"switch {i}: settled", 180, 0.2)
        b.custom.delete_namespaced_custom_object(*MD, b.ns, contract.MODEL_DEPLOYMENTS, name)
        b.wait(lambda: not b.pods(contract.LABEL_POOL), "the switch deployment's pods gone", 180)
        return _figures(runs)

    def from_scratch(self, count: int) -> dict[str, Any]:
        """The same pods (shape B, archive present) created cold by a new ModelDeployment each time
        (another engine image tag: a pool of its own, empty, so nothing is claimed warm)."""
        b, runs = self.bench, []
        b.write_archive(self.spec(SHAPE_B, 0, alternatives=False, tag="scratch"))
        for i in range(count):
            name = f"scratch-{i}"
            t0 = time.perf_counter()
            b.create_md(name, self.spec(SHAPE_B, 0, alternatives=False, tag="scratch"))
            pods = b.wait(lambda n=name: self.new_ready(n, SHAPE_B), f"scratch {i}: pods Ready", 120, 0.02)
            took = time.perf_counter() - t0
            runs.append({"to": _key(SHAPE_B), "seconds": took, "from_warm": 0, "pods": len(pods)})
            console.print(f"from scratch {i + 1}/{count}: {took * 1000:.0f} ms")
            b.custom.delete_namespaced_custom_object(*MD, b.ns, contract.MODEL_DEPLOYMENTS, name)
            b.wait(lambda n=name: not b.pods(f"{contract.LABEL_DEPLOYMENT}={n}"), "pods gone", 120)
        return _figures(runs)


def switch_verdict(runs: list[dict[str, Any]]) -> str:
    """"ok" when every switch took as many warm pods as its warm pool holds for it
    (`warm_expected`), else a FAIL line: cold pods where warm ones were meant to be measured."""
    short = [r for r in runs if r["from_warm"] < r.get("warm_expected", 0)]
    if not short:
        return "ok"
    missing = sum(r["warm_expected"] - r["from_warm"] for r in short)
    return f"FAIL: {len(short)} of {len(runs)} switches took {missing} cold pods where warm were expected"


def _figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ms = [r["seconds"] * 1000 for r in runs]
    pods = max(1, sum(r["pods"] for r in runs))
    warm, verdict = sum(r["from_warm"] for r in runs), switch_verdict(runs)
    return {"runs": runs, "p50_ms": _percentile(ms, 50), "p99_ms": _percentile(ms, 99), "max_ms": max(ms),
            "min_ms": min(ms), "warm_fraction": warm / pods, "warm_pods": warm,
            "cold_pods": sum(r["pods"] for r in runs) - warm, "verdict": verdict}


def _markdown(result: dict[str, Any]) -> str:
    sw, cold = result.get("switch") or {}, result.get("from_scratch") or {}
    lines = [
        f"# Parallelism switch by CR edit, local control plane ({result['date']})", "",
        f"Host {result['host']} ({result['cpus']} CPUs), Kubernetes {result.get('kubernetes', '?')}, kwok "
        "fake GPU nodes; the operator as a local process, archives in a local store. "
        f"{result['replicas']} replicas switching DP1 (1 GPU/pod) ↔ DP2/EP2 (2 GPUs/pod), both shapes in "
        f"`spec.parallelism.alternatives` with archives saved ahead; `warmPool.size` {result['warm']} "
        "GPUs.", "",
        "Measured: CR edit → every new-shape pod Ready with its claim naming the archive. From scratch: "
        "a new ModelDeployment of the 2-GPU shape, archive present, no warm pool, create → every pod Ready.",
        "", "| | runs | p50 ms | p99 ms | min ms | max ms | pods from the warm pool | warm / cold pods |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, fig in (("switch (CR edit)", sw), ("same pods from scratch", cold)):
        if fig:
            lines.append(f"| {label} | {len(fig['runs'])} | {fig['p50_ms']:.0f} | {fig['p99_ms']:.0f} | "
                         f"{fig['min_ms']:.0f} | {fig['max_ms']:.0f} | {fig['warm_fraction']:.0%} | "
                         f"{fig.get('warm_pods')} / {fig.get('cold_pods')} |")
    if sw:
        lines += ["", f"Verdict (switches meant to take warm pods): {sw.get('verdict')}; warm pods' engines "
                  "are played ready by `ember_testing.cluster.EngineStandIn` (kwok runs no engine)."]
    if result.get("load_average"):
        lines += ["", "Load average at the end: " + ", ".join(f"{x:.1f}" for x in result["load_average"])
                  + " (a 2-core VM shared with the control plane, kwok and MinIO)."]
    lines += ["", "kwok marks pods Ready without running them: these are the control-plane times of a "
              "switch (claim or create, schedule, Ready), not engine start or LOAD.", "",
              "Command: `ember bench switch` (benchmarks/ember_bench/switch.py).", ""]
    return "\n".join(lines)


def bench_switch(
    switches: Annotated[int, typer.Option(help="CR edits (alternating between the two shapes).")] = 20,
    replicas: Annotated[int, typer.Option(help="Replicas of the deployment.")] = 4,
    warm: Annotated[int, typer.Option(help="warmPool.size in GPUs (split over 1- and 2-GPU pods).")] = 12,
    kubeconfig: Annotated[str, typer.Option(help="Cluster (default: $KUBECONFIG or e2e/.work/kubeconfig).")]
    = "",
    out: Annotated[Path, typer.Option(help="Output path without extension (default: dated, in results/).")]
    = Path(""),
) -> None:
    """Switch latency (p50/p99) by CR edit vs the same pods from scratch, on the local control plane."""
    out = out if str(out) not in ("", ".") else (
        REPO / "benchmarks" / "results" / f"switch-local-{time.strftime('%Y%m%d')}")
    facts = {"replicas": replicas, "warm": warm}
    with operator_bench("switch", kubeconfig, out, _markdown, **facts) as (bench, result):
        run = _Switches(bench, replicas, warm)
        result["switch"] = run.switches(switches)
        result["from_scratch"] = run.from_scratch(switches)
        console.print(_markdown(result))
    verdict = (result.get("switch") or {}).get("verdict", "ok")
    if verdict != "ok":
        console.print(f"[red]{verdict}[/red]")
        raise typer.Exit(1)
