"""Status that tells the truth: store outages, replaced manifests, stuck SAVE Jobs, API rejections.

Faults are real: the operator reaches MinIO through `StoreLink`, a TCP relay the test cuts and
restores (an S3 outage as the operator sees it, without stopping the MinIO other tests share);
manifests are overwritten or deleted in the bucket; unschedulable SAVE pods come from a GPU
product no kwok node has.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_harness import (
    Api,
    OperatorProcess,
    identity_of,
    md_spec,
    operator_env,
    phase,
    play_ready_engines,
    wait_for,
    write_test_archive,
)
from support.cluster import LocalCluster, LocalMinio

pytestmark = [pytest.mark.k8s, pytest.mark.s3]


class StoreLink:
    """A TCP relay 127.0.0.1:<port> → MinIO that can be cut (connections refused) and restored."""

    def __init__(self, target: str) -> None:
        url = urllib.parse.urlsplit(target)
        self.target = (url.hostname or "127.0.0.1", url.port or 80)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.listener: socket.socket | None = None
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        self.listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def down(self) -> None:
        with self.lock:
            socks, self.conns = [self.listener, *self.conns], []
            self.listener = None
        for s in socks:
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                if self.listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def env(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> Iterator[tuple[Api, OperatorProcess, str]]:
    with operator_env(k8s, minio, tmp_path, "ops") as env:
        yield env


@pytest.fixture
def link(minio: LocalMinio) -> Iterator[StoreLink]:
    relay = StoreLink(minio.endpoint)
    yield relay
    relay.down()


def _via(spec: dict[str, Any], link: StoreLink) -> dict[str, Any]:
    spec["store"]["s3"]["endpoint"] = link.endpoint
    return spec


def _archives(api: Api, md: str) -> list[str]:
    return [(p.metadata.annotations or {}).get("ember.dev/archive", "?") for p in api.serving(md)]


def _restoring(api: Api, md: str, count: int, digest: str) -> bool:
    pods = api.serving(md)
    return len(pods) == count and all(
        p.metadata.annotations.get("ember.dev/archive", "").endswith("/manifest")
        and p.metadata.annotations.get("ember.dev/manifest-digest") == digest for p in pods)


def _ga_status(api: Api, spec: dict[str, Any]) -> dict[str, Any]:
    ga = api.archive(f"ga-{identity_of(spec).hash()[:16]}")
    return (ga or {}).get("status") or {}


def test_native_pods_move_to_the_archive_after_an_outage(
    env: Any, minio: LocalMinio, link: StoreLink,
) -> None:
    """Issue 18 item 1: S3 down at creation → native pods; S3 back with the archive → restoring pods."""
    api, op, prefix = env
    spec = _via(md_spec(minio, prefix), link)  # the link is down: the store is unreachable
    api.create_md("outage", spec)
    wait_for(lambda: api.condition("outage", "ArchiveReady").get("reason") == "StoreUnreachable",
             "ArchiveReady=False StoreUnreachable", op)
    wait_for(lambda: _archives(api, "outage") == ["", ""], "2 native pods", op)
    wait_for(lambda: api.condition("outage", "Available").get("reason") == "NativeCapture",
             "Available says NativeCapture (from the pods)", op)
    assert api.md("outage")["status"]["nativeReplicas"] == 2

    write_test_archive(minio, prefix, spec)
    link.up()
    digest = wait_for(lambda: (st := _ga_status(api, spec)).get("phase") == "Available" and st["digest"],
                      "GraphArchive Available after the outage", op)
    wait_for(lambda: _restoring(api, "outage", 2, digest), "native pods replaced by restoring pods", op)
    wait_for(lambda: phase(api, "outage") == "Ready", "Ready", op)
    st = api.md("outage")["status"]
    assert st["nativeReplicas"] == 0 and api.condition("outage", "Available")["reason"] == "ReplicasReady"


def test_store_blip_during_save_does_not_start_native_pods(
    env: Any, minio: LocalMinio, link: StoreLink,
) -> None:
    """Issue 18 item 1: a StoreUnreachable probe while the SAVE Job runs is not a failing archive."""
    api, op, prefix = env
    link.up()
    spec = _via(md_spec(minio, prefix, save={"podAnnotations": {
        "pod-complete.stage.kwok.x-k8s.io/delay": "600s"}}), link)  # the SAVE pod keeps running
    api.create_md("blip", spec)
    wait_for(lambda: phase(api, "blip") == "Saving" and api.jobs(), "Saving with a SAVE Job", op)
    link.down()
    wait_for(lambda: any(c.get("reason") == "StoreUnreachable"
                         for c in _ga_status(api, spec).get("conditions") or []),
             "the operator saw the blip", op, timeout=30)
    for _ in range(12):  # several reconciles (resync 5 s): still no native pod
        assert api.serving("blip") == [], "native pods started during a store blip"
        assert _ga_status(api, spec)["phase"] == "Saving"
        time.sleep(1)
    write_test_archive(minio, prefix, spec)
    link.up()
    digest = wait_for(lambda: (st := _ga_status(api, spec)).get("phase") == "Available" and st["digest"],
                      "GraphArchive Available", op)
    wait_for(lambda: _restoring(api, "blip", 2, digest), "2 restoring pods", op)


def _manifest_key(prefix: str, spec: dict[str, Any]) -> str:
    return f"{prefix}/archives/{identity_of(spec).hash()}/manifest"


def test_garbage_manifest_is_failed_not_available(env: Any, minio: LocalMinio) -> None:
    """Issue 18 item 2: a manifest that does not parse is Failed with the reason; pods serve natively."""
    api, op, prefix = env
    spec = md_spec(minio, prefix)
    minio.client().put_object(Bucket=minio.bucket, Key=_manifest_key(prefix, spec), Body=b"{not a manifest")
    api.create_md("garbage", spec)
    st = wait_for(lambda: (s := _ga_status(api, spec)).get("phase") == "Failed" and s,
                  "GraphArchive Failed", op)
    saved = next(c for c in st["conditions"] if c["type"] == "Saved")
    assert saved["reason"] == "ManifestInvalid" and "not a readable ember manifest" in saved["message"]
    assert not st.get("uri")
    wait_for(lambda: api.condition("garbage", "ArchiveReady").get("reason") == "ManifestInvalid",
             "ArchiveReady=False ManifestInvalid", op)
    wait_for(lambda: _archives(api, "garbage") == ["", ""], "2 native pods", op)


def test_manifest_replaced_or_deleted_after_available_is_noticed(env: Any, minio: LocalMinio) -> None:
    """Issue 18 item 2: the timer re-checks an Available archive. Replaced (even by a consistent
    manifest): new digest, Warning, pods re-pinned; deleted: not Available, SAVE again."""
    api, op, prefix = env
    spec = md_spec(minio, prefix)
    write_test_archive(minio, prefix, spec)
    api.create_md("swap", spec)
    first = wait_for(lambda: (st := _ga_status(api, spec)).get("phase") == "Available" and st["digest"],
                     "Available", op)
    wait_for(lambda: _restoring(api, "swap", 2, first), "2 pods pinned to the manifest", op)
    key, s3 = _manifest_key(prefix, spec), minio.client()
    body = s3.get_object(Bucket=minio.bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=minio.bucket, Key=key, Body=body + b"\n")  # same archive, other bytes
    second = wait_for(lambda: (d := _ga_status(api, spec).get("digest")) != first and d,
                      "the new digest", op, timeout=30)
    ga_name = f"ga-{identity_of(spec).hash()[:16]}"
    # the Warning is its own API write after the status patch: waited for, not read at once
    wait_for(lambda: any(e["reason"] == "ManifestReplaced" for e in api.events_for(ga_name)),
             "the ManifestReplaced Warning", op, timeout=30)
    wait_for(lambda: _restoring(api, "swap", 2, second), "pods re-pinned to the new digest", op)

    s3.delete_object(Bucket=minio.bucket, Key=key)
    wait_for(lambda: _ga_status(api, spec).get("phase") == "Saving" and api.jobs(), "SAVE again", op,
             timeout=30)
    assert not _ga_status(api, spec).get("uri")
    wait_for(lambda: api.condition("swap", "ArchiveReady").get("reason") == "Saving",
             "the deployment follows: ArchiveReady=False Saving", op)


def test_in_between_identity_of_two_quick_edits_is_not_saved(env: Any, minio: LocalMinio) -> None:
    """Issue 18 item 7: edit A → B → C; B's SAVE Job (nobody wants B) is deleted and its
    GraphArchive collected; A's archive stays while A's pods serve, C saves."""
    api, op, prefix = env
    slow = {"podAnnotations": {"pod-complete.stage.kwok.x-k8s.io/delay": "600s"}}
    spec_a = md_spec(minio, prefix, replicas=1, save=slow)
    write_test_archive(minio, prefix, spec_a)
    api.create_md("edits", spec_a)
    wait_for(lambda: phase(api, "edits") == "Ready", "Ready on A", op)
    hashes: dict[str, str] = {}
    for rev in ("b", "c"):
        spec = {**spec_a, "model": {"name": spec_a["model"]["name"], "revision": rev}}
        hashes[rev] = identity_of(spec).hash()[:16]
        api.patch_md("edits", {"spec": {"model": spec["model"]}})
        wait_for(lambda h=hashes[rev]: any(h in j.metadata.name for j in api.jobs()),
                 f"SAVE Job of {rev}", op)
    wait_for(lambda: not any(hashes["b"] in j.metadata.name for j in api.jobs()),
             "the SAVE Job of the in-between identity deleted", op, timeout=30)
    wait_for(lambda: api.archive(f"ga-{hashes['b']}") is None, "its GraphArchive collected", op, timeout=60)
    assert any(hashes["c"] in j.metadata.name for j in api.jobs())
    assert api.archive(f"ga-{identity_of(spec_a).hash()[:16]}") is not None  # A's pods still serve


def test_unschedulable_save_pod_is_not_reported_running(env: Any, minio: LocalMinio) -> None:
    """Issue 18 item 3: a SAVE pod no node can take (no kwok node has this GPU product)."""
    api, op, prefix = env
    spec = md_spec(minio, prefix, product="NVIDIA-NO-SUCH-GPU")
    api.create_md("nogpu", spec)
    cond = wait_for(lambda: (c := api.condition("nogpu", "ArchiveReady")).get("reason") == "SaveUnschedulable"
                    and c, "ArchiveReady=False SaveUnschedulable", op)
    assert "Unschedulable" in cond["message"] and "running" not in cond["message"].replace("cannot run", "")
    ga = f"ga-{identity_of(spec).hash()[:16]}"
    saved = next(c for c in _ga_status(api, spec)["conditions"] if c["type"] == "Saved")
    assert saved["reason"] == "SaveUnschedulable" and "node" in saved["message"]
    wait_for(lambda: any(e["reason"] == "SaveUnschedulable" and e["type"] == "Warning"
                         for e in api.events_for(ga)), "Warning event on the GraphArchive", op)


def test_save_job_whose_pod_cannot_be_created_is_not_reported_running(env: Any, minio: LocalMinio) -> None:
    """Issue 18 item 3: FailedCreate (a ResourceQuota of zero pods refuses the SAVE pod)."""
    api, op, prefix = env
    api.core.create_namespaced_resource_quota(api.ns, {
        "metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}})
    spec = md_spec(minio, prefix)
    api.create_md("quota", spec)
    cond = wait_for(lambda: (c := api.condition("quota", "ArchiveReady")).get("reason") == "SaveFailedCreate"
                    and c, "ArchiveReady=False SaveFailedCreate", op)
    assert "FailedCreate" in cond["message"] and "quota" in cond["message"]


def _quota(api: Api, hard: dict[str, str]) -> None:
    api.core.create_namespaced_resource_quota(api.ns, {"metadata": {"name": "q"}, "spec": {"hard": hard}})


def test_pods_refused_by_the_apiserver_are_in_status_and_events(env: Any, minio: LocalMinio) -> None:
    """Issue 18 item 4: pod creation answered 403 (a quota of zero pods): a Warning event and
    Progressing=False CreateRejected naming the pod and the API's message, no crash loop."""
    api, op, prefix = env
    spec = md_spec(minio, prefix)
    write_test_archive(minio, prefix, spec)
    _quota(api, {"pods": "0"})
    api.create_md("refused", spec)
    cond = wait_for(lambda: (c := api.condition("refused", "Progressing")).get("reason") == "CreateRejected"
                    and c, "Progressing=False CreateRejected", op)
    assert "pod refused-" in cond["message"] and "exceeded quota" in cond["message"], cond["message"]
    assert phase(api, "refused") == "Degraded" and api.md("refused")["status"]["replicas"] == 0
    wait_for(lambda: any(e["reason"] == "CreateRejected" and e["type"] == "Warning"
                         for e in api.events_for("refused")), "Warning event CreateRejected", op)


def test_save_job_refused_by_the_apiserver_fails_the_attempt(env: Any, minio: LocalMinio) -> None:
    """Issue 18 item 4: Job creation answered 403 (a quota of zero Jobs): the attempt is Failed
    with the API's message and retried after the backoff; the deployment serves natively."""
    api, op, prefix = env
    _quota(api, {"count/jobs.batch": "0"})
    spec = md_spec(minio, prefix)
    api.create_md("nojob", spec)
    st = wait_for(lambda: (s := _ga_status(api, spec)).get("phase") == "Failed" and s,
                  "GraphArchive Failed", op)
    saved = next(c for c in st["conditions"] if c["type"] == "Saved")
    assert saved["reason"] == "CreateRejected" and "exceeded quota" in saved["message"]
    wait_for(lambda: api.condition("nojob", "ArchiveReady").get("reason") == "CreateRejected",
             "ArchiveReady=False CreateRejected", op)
    wait_for(lambda: _archives(api, "nojob") == ["", ""], "2 native pods", op)


def test_warm_claims_is_a_lifetime_counter(env: Any, minio: LocalMinio) -> None:
    """Issue 18 item 5: status.warmClaims only grows: through scale up/down, /scale, a SIGKILLed
    and restarted operator and a scale to zero (it is never rewritten from a fresh status)."""
    api, op, prefix = env
    play_ready_engines(api)
    spec = md_spec(minio, prefix, replicas=1, warmPool={"size": 2})
    write_test_archive(minio, prefix, spec)
    api.create_md("warm", spec)
    seen: list[int] = []
    stop = threading.Event()

    def record() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                value = (api.md("warm").get("status") or {}).get("warmClaims")
                if value is not None and (not seen or seen[-1] != value):
                    seen.append(value)
            time.sleep(0.1)

    threading.Thread(target=record, daemon=True).start()
    try:
        wait_for(lambda: phase(api, "warm") == "Ready" and len(api.warm()) == 2, "Ready with 2 warm pods", op)
        before = seen[-1] if seen else 0
        api.k8s.kubectl("scale", "-n", api.ns, "md/warm", "--replicas=3")
        wait_for(lambda: seen and seen[-1] >= before + 2, "two warm claims counted", op)
        op.kill()
        op.start()
        api.patch_md("warm", {"spec": {"replicas": 0}})
        wait_for(lambda: phase(api, "warm") == "Ready" and not api.serving("warm"), "scaled to zero", op)
        api.patch_md("warm", {"spec": {"replicas": 2}})
        wait_for(lambda: len(api.serving("warm")) == 2, "2 pods again", op)
        time.sleep(6)  # a timer pass or two
    finally:
        stop.set()
    assert seen == sorted(seen) and seen[-1] >= before + 2, seen
