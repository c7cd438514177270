"""`ember bench claims`: warm-pool claim latency and reconcile throughput of the operator.

Runs on the local control plane (e2e/cluster.sh up: kube-apiserver, controller-manager,
scheduler, kwok fake GPU nodes). The operator runs as a subprocess watching a fresh namespace;
the archive is pre-written into a local store so no SAVE Job is needed; the bench adds its own
kwok GPU nodes (product `NVIDIA-EMBER-BENCH`) so hundreds of one-GPU pods fit.

1. Claims: a ModelDeployment with a warm pool of N ready pods is scaled 0 → N through /scale.
   Per pod: time from the scale request to the pod being seen claimed (label
   ember.dev/pool=serving, through a watch): p50/p99/max, and time until every pod is claimed.
2. Throughput: M ModelDeployments (one replica each) created at once; time until every one is
   reconciled (observedGeneration = generation, phase Ready), and the operator's own
   ember_reconcile_seconds histogram.

Figures go to benchmarks/results/operator-local.{json,md}.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from ember import contract
from ember_testing.cluster import EngineStandIn, fake_gpu_nodes, kubectl_apply

REPO = Path(__file__).resolve().parents[2]
BENCH_PRODUCT = "NVIDIA-EMBER-BENCH"
MD = (contract.GROUP, contract.VERSION)  # the ModelDeployment API (with contract.MODEL_DEPLOYMENTS)
WARM = f"{contract.LABEL_POOL}={contract.POOL_WARM}"  # label selectors of warm and claimed pods
SERVING = f"{contract.LABEL_POOL}={contract.POOL_SERVING}"
console = Console()


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _histogram_quantile(metrics: dict[str, float], name: str, q: float) -> float | None:
    """Quantile of a Prometheus histogram from its cumulative buckets (linear inside a bucket)."""
    buckets = sorted(
        (float(k.split('le="')[1].rstrip('"}')), v) for k, v in metrics.items()
        if k.startswith(f"{name}_bucket{{") and 'le="+Inf"' not in k
    )
    total = metrics.get(f"{name}_count", 0.0)
    if not buckets or total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = upper, count
    return buckets[-1][0]


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ember_") and " " in line:
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def engine_ready(pod: Any) -> bool:
    """A pod Ready (kwok) whose engine says ready (`ember.dev/engine`): the operator may claim it."""
    ready = any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))
    return ready and (pod.metadata.annotations or {}).get(contract.ANN_ENGINE) == contract.ENGINE_READY


def claims_verdict(replicas: int, warm: int, cold: int) -> str:
    """The claims run measures warm claims: "ok" when every replica took a warm pod, else a FAIL
    line (a cold pod's figures are not a claim's)."""
    if cold == 0 and warm >= replicas:
        return "ok"
    return f"FAIL: {warm} of {replicas} replicas took a warm pod, {cold} a cold one"


def _claim_figures(latencies_ms: list[float], metrics: dict[str, float]) -> dict[str, Any]:
    """Claim latency percentiles (sorted per-pod ms) and the operator's own claim histograms."""
    return {
        "claim_ms": {
            "p50": round(_percentile(latencies_ms, 50), 1),
            "p90": round(_percentile(latencies_ms, 90), 1),
            "p99": round(_percentile(latencies_ms, 99), 1),
            "max": round(latencies_ms[-1], 1) if latencies_ms else None,
            "mean": round(statistics.fmean(latencies_ms), 1) if latencies_ms else None,
        },
        "all_claimed_ms": round(latencies_ms[-1], 1) if latencies_ms else None,
        # Operator-side views (histograms): reconcile start → claim accepted, and one claim's
        # API round trip.
        "operator_claim_ms": {
            "p50": _ms(_histogram_quantile(metrics, "ember_claim_seconds", 0.5)),
            "p99": _ms(_histogram_quantile(metrics, "ember_claim_seconds", 0.99)),
        },
        "claim_patch_ms": {
            "p50": _ms(_histogram_quantile(metrics, "ember_claim_patch_seconds", 0.5)),
            "p99": _ms(_histogram_quantile(metrics, "ember_claim_patch_seconds", 0.99)),
        },
    }


class _Bench:
    def __init__(self, kubeconfig: str, workdir: Path) -> None:
        from kubernetes import client, config

        self.kubeconfig = kubeconfig
        self.api = config.new_client_from_config(config_file=kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.workdir = workdir
        self.ns = f"bench-{uuid.uuid4().hex[:6]}"
        self.store = workdir / "store"
        self.op: subprocess.Popen[bytes] | None = None
        self.engines: EngineStandIn | None = None
        self.metrics_port = _free_port()

    # ---- setup
    def setup(self) -> None:
        from kubernetes import client

        crds = [json.loads(json.dumps(__import__("yaml").safe_load(p.read_text())))
                for p in sorted((REPO / "crds").glob("*.yaml"))]
        kubectl_apply(self.kubeconfig, crds)
        kubectl_apply(self.kubeconfig, fake_gpu_nodes("ember-bench-gpu", BENCH_PRODUCT))
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=self.ns)))
        deadline = time.monotonic() + 60
        sa = "metadata.name=default"
        while not self.core.list_namespaced_service_account(self.ns, field_selector=sa).items:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no default service account in {self.ns}")
            time.sleep(0.2)
        # kwok runs no engine: play the sidecar's `ember.dev/engine: ready` on warm pods, as the
        # k8s tests do, or the operator claims none of them (identity-keyed pools).
        self.engines = EngineStandIn(self.kubeconfig, self.ns).__enter__()
        env = {
            **os.environ, "KUBECONFIG": self.kubeconfig, "PYTHONUNBUFFERED": "1",
            "EMBER_OPERATOR_NAMESPACES": self.ns, "EMBER_OPERATOR_STANDALONE": "true",
            "EMBER_OPERATOR_METRICS_PORT": str(self.metrics_port),
            "EMBER_OPERATOR_METRICS_HOST": "127.0.0.1",
            "EMBER_OPERATOR_SIDECAR_IMAGE": "registry.invalid/ember/ember:bench",
            "EMBER_OPERATOR_DEFAULT_STORE": self.store.as_uri(),
            "EMBER_OPERATOR_LOCAL_STORE_ROOT": str(self.workdir),  # the operator reads the store itself
            # the bench's pool is its size (100 by default): the per-deployment cap (64) would keep
            # the pool below the claims the bench waits for
            "EMBER_OPERATOR_MAX_WARM_GPUS": "0",
        }
        log = (self.workdir / "operator.log").open("ab")
        self.op = subprocess.Popen([sys.executable, "-m", "ember_operator.main"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, cwd=str(REPO))
        self.wait(self._metrics_up, "the operator's metrics endpoint", 120)

    def _metrics_up(self) -> bool:
        try:
            _scrape(self.metrics_port)
        except OSError:
            return False
        return True

    def teardown(self) -> None:
        if self.engines is not None:
            self.engines.__exit__()
        if self.op is not None and self.op.poll() is None:
            self.op.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.op.wait(timeout=15)
            if self.op.poll() is None:
                self.op.kill()
        with contextlib.suppress(Exception):
            # The operator is gone: drop its cleanup finalizers so the namespace can be deleted.
            for md in self.deployments():
                self.custom.patch_namespaced_custom_object(
                    *MD, self.ns, contract.MODEL_DEPLOYMENTS, md["metadata"]["name"],
                    {"metadata": {"finalizers": None}})
        with contextlib.suppress(Exception):
            self.core.delete_namespace(self.ns)

    def spec(self, model: str, replicas: int, warm: int, image_tag: str = "bench") -> dict[str, Any]:
        return {
            "model": {"name": model},
            "engine": {"kind": "transformers", "version": "4.57.0",
                       "image": f"registry.invalid/ember/engine:{image_tag}"},
            "capture": {"sizes": [1, 2, 4, 8], "maxBatch": 8, "maxNumTokens": 2048},
            "gpu": {"product": BENCH_PRODUCT},
            "replicas": replicas,
            "warmPool": {"size": warm},
        }

    def write_archive(self, spec: dict[str, Any]) -> None:
        from ember.archive.bundle import write_archive
        from ember.identity import CompatKey
        from ember.store import LocalStore
        from ember_operator.api import ModelDeploymentSpec
        from ember_testing.synthetic import synthetic_graphset, synthetic_images

        ident = ModelDeploymentSpec.model_validate(spec).identity()
        compat = CompatKey(gpu_name="bench", compute_capability="9.0", driver="0", cuda="13.0")
        write_archive(LocalStore(self.store), synthetic_graphset(graphs=4, nodes=30, groups=1), ident, compat,
                      kernel_images=synthetic_images())

    def create_md(self, name: str, spec: dict[str, Any]) -> None:
        body = {"apiVersion": contract.API_VERSION, "kind": contract.KIND_MODEL_DEPLOYMENT,
                "metadata": {"name": name}, "spec": spec}
        self.custom.create_namespaced_custom_object(
            *MD, self.ns, contract.MODEL_DEPLOYMENTS, body)

    def deployments(self) -> list[dict[str, Any]]:
        """The ModelDeployments of the bench's namespace (plain dicts)."""
        body: Any = self.custom.list_namespaced_custom_object(
            *MD, self.ns, contract.MODEL_DEPLOYMENTS)
        return list(body["items"])

    def pods(self, selector: str) -> list[Any]:
        return [p for p in self.core.list_namespaced_pod(self.ns, label_selector=selector).items
                if p.metadata is None or p.metadata.deletion_timestamp is None]

    def wait(self, predicate: Any, what: str, timeout: float, interval: float = 0.2) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(interval)
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")

    # ---- 1. claims
    def claims(self, replicas: int) -> dict[str, Any]:
        spec = self.spec("bench/claims", 0, replicas)
        self.write_archive(spec)
        self.create_md("claims", spec)

        def warm_ready() -> bool:
            pods = self.pods(WARM)
            return len(pods) >= replicas and sum(map(engine_ready, pods)) >= replicas

        t = time.monotonic()
        self.wait(warm_ready, f"{replicas} warm pods Ready with a ready engine", 300)
        warm_fill_s = time.monotonic() - t
        time.sleep(2.0)  # let the operator settle
        seen: dict[str, float] = {}
        started = threading.Event()
        done = threading.Event()
        meta = self.core.list_namespaced_pod(self.ns).metadata
        rv = meta.resource_version if meta is not None else None
        thread = threading.Thread(target=self._watch_claimed, daemon=True,
                                  args=("claims", replicas, rv, seen, started, done))
        thread.start()
        started.wait()
        time.sleep(0.5)
        t0 = time.monotonic()
        self.custom.patch_namespaced_custom_object_scale(
            *MD, self.ns, contract.MODEL_DEPLOYMENTS, "claims", {"spec": {"replicas": replicas}})
        thread.join(timeout=120)
        done.set()
        latencies = sorted((t - t0) * 1000 for t in seen.values())
        serving = self.pods(f"{contract.LABEL_DEPLOYMENT}=claims,{SERVING}")
        cold = [p for p in serving if not p.metadata.name.startswith("ember-warm-")]
        metrics = _scrape(self.metrics_port)
        t = time.monotonic()
        self.wait(lambda: len(self.pods(WARM)) >= replicas, "pool replenished", 300)
        return {
            "replicas": replicas,
            "claimed": len(seen),
            "warm_claims": len(serving) - len(cold),
            "cold_created": len(cold),
            "verdict": claims_verdict(replicas, len(serving) - len(cold), len(cold)),
            "warm_fill_s": round(warm_fill_s, 2),
            **_claim_figures(latencies, metrics),
            "replenish_s": round(time.monotonic() - t, 2),
        }

    def _watch_claimed(self, deployment: str, replicas: int, resource_version: str, seen: dict[str, float],
                       started: threading.Event, done: threading.Event) -> None:
        """Record in `seen` when each pod of `deployment` is first seen claimed (pool=serving), until
        `replicas` are or `done` is set."""
        from kubernetes import watch

        w = watch.Watch()
        started.set()
        for event in w.stream(self.core.list_namespaced_pod, self.ns, resource_version=resource_version,
                              timeout_seconds=300):
            pod = event["object"]
            labels = pod.metadata.labels or {}
            ours = labels.get(contract.LABEL_DEPLOYMENT) == deployment
            if ours and labels.get(contract.LABEL_POOL) == contract.POOL_SERVING:
                seen.setdefault(pod.metadata.name, time.monotonic())
            if len(seen) >= replicas or done.is_set():
                w.stop()

    # ---- 2. reconcile throughput
    def throughput(self, deployments: int) -> dict[str, Any]:
        # Its own engine image: a pool of its own (none), so the claims run's warm pool is not used.
        spec = self.spec("bench/throughput", 1, 0, image_tag="bench-throughput")
        self.write_archive(spec)
        before = _scrape(self.metrics_port)
        t0 = time.monotonic()
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:  # a burst, as a GitOps sync would apply them
            list(pool.map(lambda i: self.create_md(f"tp-{i:03d}", spec), range(deployments)))
        created_s = time.monotonic() - t0

        def all_ready() -> bool:
            ours = [m for m in self.deployments() if m["metadata"]["name"].startswith("tp-")]
            return len(ours) == deployments and all(
                (m.get("status") or {}).get("observedGeneration") == m["metadata"]["generation"]
                and (m.get("status") or {}).get("phase") == "Ready" for m in ours)

        # Poll gently: listing every deployment is itself load on a small control plane.
        self.wait(all_ready, f"{deployments} deployments Ready", 900, interval=2.0)
        total = time.monotonic() - t0
        after = _scrape(self.metrics_port)
        key_sum = 'ember_reconcile_seconds_sum{kind="ModelDeployment"}'
        key_count = 'ember_reconcile_seconds_count{kind="ModelDeployment"}'
        n = after.get(key_count, 0) - before.get(key_count, 0)
        s = after.get(key_sum, 0) - before.get(key_sum, 0)
        return {
            "deployments": deployments,
            "create_requests_s": round(created_s, 2),
            "all_ready_s": round(total, 2),
            "deployments_per_s": round(deployments / total, 1),
            "reconciles": int(n),
            "reconciles_per_s": round(n / total, 1),
            "mean_reconcile_ms": round(1000 * s / n, 1) if n else None,
        }


def _markdown(result: dict[str, Any]) -> str:
    c, tp = result.get("claims") or {}, result.get("throughput") or {}
    lines = [
        "# Operator on the local control plane",
        "",
        f"Host: {result['host']} · {result['cpus']} CPUs · Kubernetes {result.get('kubernetes', '?')} "
        f"(kube-apiserver + controller-manager + scheduler, kwok fake GPU nodes) · {result['date']}",
        "",
        "## Warm-pool claims (scale 0 → N through /scale)",
        "",
        "| replicas | claimed | warm | cold | p50 ms | p90 ms | p99 ms | max ms (all) | replenish s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if c:
        m = c["claim_ms"]
        lines.append(f"| {c['replicas']} | {c['claimed']} | {c.get('warm_claims')} | {c['cold_created']} | "
                     f"{m['p50']} | {m['p90']} | {m['p99']} | {m['max']} | {c['replenish_s']} |")
        lines += ["", f"Verdict: {c.get('verdict')} (warm pods' engines played ready by "
                  "`ember_testing.cluster.EngineStandIn`: kwok runs no engine)."]
        op, patch = c.get("operator_claim_ms") or {}, c.get("claim_patch_ms") or {}
        lines += [
            "",
            f"Operator side: reconcile start → claim accepted p50 {op.get('p50')} ms / "
            f"p99 {op.get('p99')} ms; "
            f"one claim's API round trip (conditional patch) p50 {patch.get('p50')} ms / "
            f"p99 {patch.get('p99')} ms (from histogram buckets).",
        ]
    lines += [
        "",
        "Per-claim latency = time from the /scale request to the pod being seen (watch) with "
        "`ember.dev/pool=serving`; goal p99 ≤ 250 ms.",
        "",
        "## Reconcile throughput",
        "",
        "| deployments | all Ready s | deployments/s | reconciles | reconciles/s | mean reconcile ms |",
        "|---|---|---|---|---|---|",
    ]
    if tp:
        lines.append(f"| {tp['deployments']} | {tp['all_ready_s']} | {tp['deployments_per_s']} | "
                     f"{tp['reconciles']} | "
                     f"{tp['reconciles_per_s']} | {tp['mean_reconcile_ms']} |")
    if result.get("error"):
        lines += ["", f"Run ended early: {result['error']}"]
    if result.get("load_average"):
        lines += ["", "Host load average (1/5/15 min) at the end: "
                  + ", ".join(f"{x:.1f}" for x in result["load_average"])
                  + " — the machine is shared with other builds; figures are upper bounds."]
    lines += ["", "Command: `ember bench claims` (see docs/operator.md).", ""]
    return "\n".join(lines)


@contextlib.contextmanager
def operator_bench(
    name: str, kubeconfig: str, out: Path, markdown: Callable[[dict[str, Any]], str], **facts: Any
) -> Iterator[tuple[_Bench, dict[str, Any]]]:
    """The operator running in a fresh namespace of the local control plane; yields it and the
    result dict, which is written to `out`.json / .md (with `markdown`) whatever happens."""
    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or str(REPO / "e2e" / ".work" / "kubeconfig")
    workdir = Path(tempfile.mkdtemp(prefix=f"ember-bench-{name}-"))
    bench = _Bench(kubeconfig, workdir)
    result: dict[str, Any] = {
        "host": platform.node(), "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "namespace": bench.ns, **facts,
    }
    with contextlib.suppress(Exception):
        from kubernetes import client

        result["kubernetes"] = client.VersionApi(bench.api).get_code().git_version
    try:
        bench.setup()
        console.print(f"operator running in namespace {bench.ns} (log {workdir / 'operator.log'})")
        yield bench, result
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        bench.teardown()
        with contextlib.suppress(OSError):
            result["load_average"] = os.getloadavg()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(result))
        console.print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


def bench_claims(
    replicas: Annotated[int, typer.Option(help="Warm pool size and scale-up target.")] = 100,
    deployments: Annotated[int, typer.Option(help="ModelDeployments for the throughput run (0 skips).")]
    = 200,
    kubeconfig: Annotated[str, typer.Option(help="Cluster (default: $KUBECONFIG or e2e/.work/kubeconfig).")]
    = "",
    out: Annotated[Path, typer.Option(help="Output path without extension.")]
    = REPO / "benchmarks" / "results" / "operator-local",
) -> None:
    """Warm-pool claim latency (p50/p99) and reconcile throughput on the local control plane."""
    with operator_bench("claims", kubeconfig, out, _markdown) as (bench, result):
        if replicas > 0:
            result["claims"] = bench.claims(replicas)
            console.print_json(json.dumps(result["claims"]))
        if deployments > 0:
            result["throughput"] = bench.throughput(deployments)
            console.print_json(json.dumps(result["throughput"]))
    verdict = (result.get("claims") or {}).get("verdict", "ok")
    if verdict != "ok":
        console.print(f"[red]{verdict}[/red]")
        raise typer.Exit(1)
