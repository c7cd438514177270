"""Faults injected while the operator works; nothing is lost or duplicated, and it converges in a bound.

Real faults on the shared local control plane (run under the k8s lock):
- kube-apiserver restarted (SIGTERM, start with the same flags and etcd): a throwaway apiserver
  of the cluster's own command line on another port, the only one the test's operator talks to
  (`OwnApiserver`: the cluster's apiserver, which the demo's operator may be using, is never
  restarted): mid-SAVE, and while idle with the periodic resync set to 300 s, so an edit seen
  quickly afterwards proves the operator's watch streams were re-established (not the timer);
- MinIO unreachable and back: the operator reaches MinIO through `StoreLink` (a relay the test
  cuts; in this suite the operator is the only MinIO client, kwok's SAVE and serving pods run no
  code), so the shared MinIO other tests use is not stopped;
- the SAVE Job's pod deleted mid-run;
- a kwok node deleted with serving pods on it (the pod GC removes its pods, the operator replaces them).

Each test checks afterwards: the deployment Ready with its replicas restoring the archive, no orphan
pods (every ember pod belongs to an existing deployment or SAVE Job, on an existing node), at most
one SAVE Job per identity and attempt and never two running, and conditions that say what happened
(while the fault lasts and after). Each prints the measured convergence time; with
EMBER_FAULTS_RESULTS=<path> the module writes the table there (benchmarks/results/faults-local-*.md).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from operator_harness import (
    Api,
    OperatorProcess,
    free_port,
    identity_of,
    md_spec,
    operator_env,
    phase,
    wait_for,
    write_test_archive,
)
from sa_identity import operator_kubeconfig
from support.cluster import REPO, LocalCluster, LocalMinio, wait_until
from test_operator_status import StoreLink

from ember_testing.cluster import fake_gpu_nodes, kubectl_apply, kubectl_bin

pytestmark = [pytest.mark.k8s, pytest.mark.s3, pytest.mark.slow]

RESULTS: list[tuple[str, str, float, float]] = []  # fault, what the system did, seconds, bound
LONG_SAVE = {"podAnnotations": {"pod-complete.stage.kwok.x-k8s.io/delay": "600s"}}  # SAVE pod keeps running


@pytest.fixture(scope="module", autouse=True)
def results_table() -> Iterator[None]:
    yield
    lines = ["| fault | what the system did | converged in | bound |", "|---|---|---|---|"]
    lines += [f"| {f} | {did} | {secs:.1f} s | {bound:.0f} s |" for f, did, secs, bound in RESULTS]
    print("\n" + "\n".join(lines))
    out = os.environ.get("EMBER_FAULTS_RESULTS")
    if out and RESULTS:
        Path(out).write_text("\n".join(lines) + "\n")


def safe(pred: Callable[[], Any]) -> Callable[[], Any]:
    """A predicate that reads as False while the API server is away."""
    def run() -> Any:
        try:
            return pred()
        except Exception:  # connection refused/reset, 5xx while starting
            return False
    return run


def converge(pred: Callable[[], Any], what: str, op: OperatorProcess, bound: float) -> float:
    """Seconds until `pred` holds; it must still hold 2 s later (not a stale status read)."""
    t0 = time.monotonic()
    wait_for(safe(pred), what, op, timeout=bound)
    secs = time.monotonic() - t0
    time.sleep(2)
    wait_for(safe(pred), f"{what} (still, 2 s later)", op, timeout=30)
    return secs


class OwnApiserver:
    """A throwaway kube-apiserver for one test: the cluster's own command line (same etcd, certs
    and flags) on another port. The test's operator talks only to it, so restarting it cuts the
    operator's watches and requests exactly like a restart of the cluster's apiserver, while the
    controllers, the scheduler, kwok and any other operator (e2e/demo.sh's) keep theirs."""

    def __init__(self, k8s: LocalCluster, tmp_path: Path) -> None:
        pid = (REPO / "e2e" / ".work" / "run" / "pids" / "kube-apiserver.pid").read_text().strip()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
        self.port = free_port()
        at = argv.index("--secure-port")
        self.argv = [*argv[: at + 1], str(self.port), *argv[at + 2:]]
        self.log = tmp_path / "own-apiserver.log"
        self.main_port, self.tmp_path = argv[at + 1], tmp_path
        self.kubeconfig = self.via(k8s.kubeconfig)
        # The operator's identity (admin, or the chart's ServiceAccount under
        # EMBER_TEST_OPERATOR_KUBECONFIG=sa), through this apiserver.
        self.operator_kubeconfig = self.via(operator_kubeconfig(k8s))
        self.proc: subprocess.Popen[bytes] | None = None

    def via(self, kubeconfig: Path) -> Path:
        """A copy of `kubeconfig` that talks to this apiserver."""
        text = kubeconfig.read_text()
        assert f":{self.main_port}" in text, "the kubeconfig does not name the cluster's apiserver port"
        out = self.tmp_path / f"own-apiserver-{kubeconfig.name}"
        out.write_text(text.replace(f":{self.main_port}", f":{self.port}"))
        return out

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        wait_until(self._ready, timeout=120, interval=0.5, what="the throwaway kube-apiserver /readyz")

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-2000:]
        out = subprocess.run([kubectl_bin(), "--kubeconfig", str(self.kubeconfig), "get", "--raw",
                              "/readyz"], capture_output=True, text=True, timeout=10)
        return out.returncode == 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # as e2e/cluster.sh stops it: 10 s, then SIGKILL
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def restart(self) -> float:
        """SIGTERM, start again with the same flags, /readyz: seconds it took."""
        t0 = time.monotonic()
        self.stop()
        stopped = time.monotonic()
        self.start()
        print(f"throwaway kube-apiserver: stopped in {stopped - t0:.1f} s, "
              f"ready {time.monotonic() - stopped:.1f} s later")
        return time.monotonic() - t0


    @contextlib.contextmanager
    def unavailable(self) -> Iterator[None]:
        """The apiserver stopped, and in its place on its port, with its certificate, a server
        that answers every request `503 Service Unavailable` (an apiserver starting or stopping, a
        load balancer without a healthy backend); started again afterwards."""
        self.stop()
        flag = lambda name: self.argv[self.argv.index(name) + 1]  # noqa: E731
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(flag("--tls-cert-file"), flag("--tls-private-key-file"))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), _Unavailable)
        server.socket = tls.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield
        finally:
            server.shutdown()
            server.server_close()
            self.start()


class _Unavailable(http.server.BaseHTTPRequestHandler):
    """Every request: 503 with a Kubernetes Status body."""

    def _answer(self) -> None:
        body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 503,
                           "reason": "ServiceUnavailable", "message": "unavailable"}).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def apiserver(k8s: LocalCluster, tmp_path: Path) -> Iterator[OwnApiserver]:
    own = OwnApiserver(k8s, tmp_path)
    own.start()
    try:
        yield own
    finally:
        own.stop()


def restoring(api: Api, md: str, count: int) -> bool:
    pods = api.serving(md)
    return len(pods) == count and all(
        (p.metadata.annotations or {}).get("ember.dev/archive", "").endswith("/manifest") for p in pods)


def ready(api: Api, md: str, count: int) -> bool:
    """Ready in the status AND in the pods themselves (a status read before the pods changed is stale)."""
    pods = api.serving(md)
    pods_ready = len(pods) == count and all(
        any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or [])) for p in pods)
    st = api.md(md).get("status") or {}
    return (pods_ready and restoring(api, md, count) and st.get("phase") == "Ready"
            and st.get("readyReplicas") == count)


def check_invariants(api: Api, md: str, count: int, spec: dict[str, Any]) -> None:
    """After convergence: no orphans, no duplicate SAVE, conditions true and current."""
    nodes = {n.metadata.name for n in api.core.list_node().items}
    listed: dict[str, Any] = api.custom.list_namespaced_custom_object(
        "ember.dev", "v1alpha1", api.ns, "modeldeployments")
    mds = {m["metadata"]["name"] for m in listed["items"]}
    jobs = api.jobs()
    job_names = {j.metadata.name for j in jobs}
    for pod in api.pods("ember.dev/identity"):
        labels = pod.metadata.labels or {}
        owner = labels.get("ember.dev/deployment") or ""
        owned = labels.get("ember.dev/pool") == "warm" or owner in mds or labels.get("job-name") in job_names
        assert owned, f"orphan pod {pod.metadata.name}"
        assert pod.spec.node_name in nodes | {None}, f"pod on a deleted node {pod.metadata.name}"
    short = identity_of(spec).hash()[:16]
    ours = [j for j in jobs if j.metadata.name.startswith(f"ember-save-{short}-")]
    assert len(ours) == len({j.metadata.name for j in ours})
    assert sum(1 for j in ours if (j.status.active or 0) > 0) <= 1, "two SAVE pods running at once"
    obj = api.md(md)
    gen = obj["metadata"]["generation"]
    conds = {c["type"]: c for c in obj["status"]["conditions"]}
    assert conds["ArchiveReady"]["status"] == "True" and conds["Available"]["status"] == "True", conds
    assert all(c["observedGeneration"] == gen for c in conds.values())
    assert obj["status"]["readyReplicas"] == count and obj["status"].get("nativeReplicas", 0) == 0


def record(fault: str, did: str, secs: float, bound: float) -> None:
    print(f"FAULT {fault}: {did}; converged in {secs:.1f} s (bound {bound:.0f} s)")
    RESULTS.append((fault, did, secs, bound))


@pytest.fixture
def env(k8s: LocalCluster, minio: LocalMinio, crds: None,
        tmp_path: Path) -> Iterator[tuple[Api, OperatorProcess, str]]:
    with operator_env(k8s, minio, tmp_path, "flt") as env:
        yield env


def test_apiserver_restart_mid_save(k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
                                    apiserver: OwnApiserver) -> None:
    with operator_env(k8s, minio, tmp_path, "flt", kubeconfig=apiserver.operator_kubeconfig) as env:
        _apiserver_restart_mid_save(env, minio, apiserver)


def _apiserver_restart_mid_save(env: Any, minio: LocalMinio, apiserver: OwnApiserver) -> None:
    api, op, prefix = env
    spec = md_spec(minio, prefix, save=LONG_SAVE)
    api.create_md("api", spec)
    wait_for(lambda: phase(api, "api") == "Saving" and api.jobs(), "Saving with its SAVE Job", op)
    write_test_archive(minio, prefix, spec)  # the SAVE "finishes" as the API server goes away
    t0 = time.monotonic()
    down = apiserver.restart()
    converge(lambda: ready(api, "api", 2), "Ready with 2 restoring pods", op, bound=60)
    secs = time.monotonic() - t0  # from the SIGTERM to the API server
    assert op.proc is not None and op.proc.poll() is None, "the operator survived the restart"
    check_invariants(api, "api", 2, spec)
    assert len(api.jobs()) == 1
    record("kube-apiserver restarted mid-SAVE",
           f"restart took {down:.1f} s (graceful stop + start + /readyz); the operator reconnected, saw the "
           "archive, 1 SAVE Job, 2 restoring pods (time from the SIGTERM)", secs, 75)


def test_watch_streams_cut_by_apiserver_restart(k8s: LocalCluster, minio: LocalMinio, crds: None,
                                                tmp_path: Path, apiserver: OwnApiserver) -> None:
    # Resync 300 s: only a live watch makes the operator see the edit within the bound.
    slow_resync = {"EMBER_OPERATOR_RESYNC_SECONDS": "300"}
    with operator_env(k8s, minio, tmp_path, "flw", slow_resync, kubeconfig=apiserver.operator_kubeconfig) as (
            api, op, prefix):
        spec = md_spec(minio, prefix)
        write_test_archive(minio, prefix, spec)
        api.create_md("watch", spec)
        wait_for(lambda: ready(api, "watch", 2), "Ready", op)
        down = apiserver.restart()
        wait_for(safe(lambda: api.md("watch")), "the API server back", op)
        api.patch_md("watch", {"spec": {"replicas": 3}})
        secs = converge(lambda: ready(api, "watch", 3), "the edit applied (3 pods)", op, bound=30)
        check_invariants(api, "watch", 3, spec)
        record("watch streams cut (kube-apiserver restarted, resync 300 s)",
               f"restart took {down:.1f} s; watches re-established: a replicas 2→3 edit made after it was "
               "applied (time from the edit to Ready with 3)", secs, 30)


OUTAGE_S = 62  # longer than kopf's default API retries (1+1+2+3+5+8+13+21 = 54 s), then it gave up


def test_apiserver_outage_longer_than_the_api_retries(k8s: LocalCluster, minio: LocalMinio, crds: None,
                                                      tmp_path: Path, apiserver: OwnApiserver) -> None:
    """The apiserver answering 503 for a minute: the operator keeps retrying (it used to exit
    after ~54 s, when kopf's retries of its requests ran out) and resumes when it is back: an edit
    made then is applied. (Refused connections kopf's watches retry for ever by themselves.)"""
    with operator_env(k8s, minio, tmp_path, "fout", kubeconfig=apiserver.operator_kubeconfig) as (
            api, op, prefix):
        spec = md_spec(minio, prefix, replicas=1)
        write_test_archive(minio, prefix, spec)
        api.create_md("out", spec)
        wait_for(lambda: ready(api, "out", 1), "Ready", op)
        with apiserver.unavailable():
            time.sleep(OUTAGE_S)
            assert op.proc is not None and op.proc.poll() is None, "the operator exited during the outage"
        api.patch_md("out", {"spec": {"replicas": 2}})
        secs = converge(lambda: ready(api, "out", 2), "the edit applied (2 pods)", op, bound=45)
        check_invariants(api, "out", 2, spec)
        record(f"kube-apiserver answering 503 for {OUTAGE_S} s", "the operator kept retrying and resumed: a "
               "replicas 1→2 edit made once it was back was applied (time from the edit)", secs, 45)


def test_store_down_and_back(env: Any, minio: LocalMinio) -> None:
    """An Available archive stays Available through the outage (pods keep serving); a deployment
    created during it says StoreUnreachable and serves natively, then restores once MinIO is back."""
    api, op, prefix = env
    link = StoreLink(minio.endpoint)
    link.up()
    try:
        spec = md_spec(minio, prefix)
        spec["store"]["s3"]["endpoint"] = link.endpoint
        write_test_archive(minio, prefix, spec)
        api.create_md("s3", spec)
        wait_for(lambda: ready(api, "s3", 2), "Ready", op)
        before = {p.metadata.name for p in api.serving("s3")}
        link.down()
        t0 = time.monotonic()
        spec2 = md_spec(minio, prefix, capture={"sizes": [1, 2, 4], "maxBatch": 4, "maxNumTokens": 2048})
        spec2["store"]["s3"]["endpoint"] = link.endpoint
        api.create_md("s3b", spec2)
        wait_for(lambda: api.condition("s3b", "ArchiveReady").get("reason") == "StoreUnreachable",
                 "ArchiveReady=False StoreUnreachable on the new deployment", op, timeout=30)
        noticed = time.monotonic() - t0
        wait_for(lambda: len(api.serving("s3b")) == 2, "the new deployment serving natively", op)
        time.sleep(max(0.0, 10 - (time.monotonic() - t0)))  # two resyncs into the outage
        assert {p.metadata.name for p in api.serving("s3")} == before, "pods churned during the outage"
        assert (api.archive(f"ga-{identity_of(spec).hash()[:16]}") or {})["status"]["phase"] == "Available"
        assert api.jobs() == [], "no SAVE started because the store was unreachable"
        write_test_archive(minio, prefix, spec2)  # written while the operator cannot see the store
        link.up()
        secs = converge(lambda: ready(api, "s3", 2) and ready(api, "s3b", 2),
                        "both Ready on restoring pods", op, bound=60)
        check_invariants(api, "s3", 2, spec)
        check_invariants(api, "s3b", 2, spec2)
        assert {p.metadata.name for p in api.serving("s3")} == before
        record("MinIO unreachable ~10 s and back",
               f"Available archive kept (its pods untouched, no SAVE; no condition shows the outage); "
               f"a deployment created meanwhile: StoreUnreachable after {noticed:.1f} s, native pods, "
               "restoring pods once back (time from MinIO back)", secs, 60)
    finally:
        link.down()


def test_save_pod_deleted_mid_run(env: Any, minio: LocalMinio) -> None:
    api, op, prefix = env
    spec = md_spec(minio, prefix, save=LONG_SAVE)
    api.create_md("sv", spec)
    job = wait_for(lambda: next(iter(api.jobs()), None), "the SAVE Job", op)
    pod = wait_for(lambda: next(iter(api.pods(f"job-name={job.metadata.name}")), None), "its pod", op)
    api.core.delete_namespaced_pod(pod.metadata.name, api.ns, grace_period_seconds=0)
    t0 = time.monotonic()
    first = job.metadata.name

    def next_run() -> str:
        """A new attempt's Job (the Job failed: backoffLimit 0), or a replacement pod in the same Job."""
        if any(j.metadata.name != first for j in api.jobs()):
            return "new attempt"
        if any(p.metadata.name != pod.metadata.name for p in api.pods(f"job-name={first}")):
            return "replacement pod in the same Job"
        return ""

    how = wait_for(safe(next_run), "the SAVE running again", op, timeout=60)
    again = time.monotonic() - t0
    saved = next((c for c in ((api.archive(f"ga-{identity_of(spec).hash()[:16]}") or {}).get("status") or {})
                  .get("conditions") or [] if c["type"] == "Saved"), {})
    write_test_archive(minio, prefix, spec)
    secs = converge(lambda: ready(api, "sv", 2), "Ready", op, bound=60)
    check_invariants(api, "sv", 2, spec)
    names = sorted(j.metadata.name for j in api.jobs())
    assert len(names) <= 2 and all(n.endswith(("-0", "-1")) for n in names), names
    record("SAVE Job pod deleted mid-run",
           f"{how} after {again:.1f} s (Saved: {saved.get('reason')}); jobs {len(names)}, one per attempt; "
           "Ready once the archive was written", again + secs, 120)


def test_node_removed_with_serving_pods(env: Any, minio: LocalMinio, k8s: LocalCluster) -> None:
    api, op, prefix = env
    product = f"NVIDIA-EMBER-FAULT-{uuid.uuid4().hex[:6].upper()}"
    prefix_nodes = f"ember-fault-{uuid.uuid4().hex[:6]}"
    kubectl_apply(str(k8s.kubeconfig), fake_gpu_nodes(prefix_nodes, product, count=2, gpus=8))
    try:
        spec = md_spec(minio, prefix, product=product, replicas=4)
        write_test_archive(minio, prefix, spec)
        api.create_md("nd", spec)
        wait_for(lambda: ready(api, "nd", 4), "Ready on the two nodes", op, timeout=90)
        by_node: dict[str, list[str]] = {}
        for p in api.serving("nd"):
            by_node.setdefault(p.spec.node_name, []).append(p.metadata.name)
        victim = max(by_node, key=lambda n: len(by_node[n]))
        api.core.delete_node(victim)
        secs = converge(lambda: ready(api, "nd", 4) and all(p.spec.node_name != victim
                                                            for p in api.serving("nd")),
                        "4 pods on the remaining node", op, bound=150)
        check_invariants(api, "nd", 4, spec)
        record("kwok node deleted with serving pods",
               f"{len(by_node[victim])} pods on it removed by the pod GC, replaced on the other node",
               secs, 150)
    finally:
        for i in range(2):
            with contextlib.suppress(client.ApiException):
                api.core.delete_node(f"{prefix_nodes}-{i}")
