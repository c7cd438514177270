"""Identity-keyed warm pods, sidecar and engine side: the hand-off before the claim, the engine's
state file and its annotation, the claim putting the pod into service. A real local store and
run directory; the engine is this test, through `ember.handoff`'s helpers."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest
from support.sidecar import RecordingReporter

from ember import contract, handoff
from ember.contract import Claim
from ember.store import LocalStore
from ember_sidecar.fetching import ArchiveCache
from ember_sidecar.metrics import Metrics
from ember_sidecar.restoring import Restorer
from ember_testing.archives import write_blob_archive

WARM = {contract.LABEL_POOL: contract.POOL_WARM}
SERVING = {contract.LABEL_POOL: contract.POOL_SERVING, contract.LABEL_DEPLOYMENT: "md"}


def make(tmp_path: Path) -> tuple[Restorer, RecordingReporter, Path]:
    run_dir = tmp_path / "run"
    writer = handoff.HandoffWriter(run_dir)
    reporter = RecordingReporter()
    cache = ArchiveCache(writer.cache_dir, retry_s=0.5, timeout_s=30)
    return Restorer(cache, writer, Metrics(), reporter), reporter, run_dir


def bound_annotations(store: LocalStore, identity: str, digest: str) -> dict[str, str]:
    """What the operator creates an identity-keyed warm pod with: the claim minus its stamp."""
    return Claim(store.manifest_uri(identity), identity, world=1, engine_args=("--x", "1"),
                 manifest_digest=digest).annotations()


def test_engine_state_helpers_write_what_the_sidecar_reads(tmp_path: Path) -> None:
    result = handoff.HandoffResult(None, identity="abc", run_dir=tmp_path)
    assert handoff.read_engine_state(tmp_path) is None
    handoff.engine_loading(result)
    assert handoff.read_engine_state(tmp_path)["state"] == contract.ENGINE_LOADING
    handoff.engine_ready(result, gpu_bytes=123)
    st = handoff.read_engine_state(tmp_path)
    assert st is not None and st["state"] == "ready" and st["identity"] == "abc" and st["gpu_bytes"] == 123
    handoff.engine_failed("cuda OOM", result)
    st = handoff.read_engine_state(tmp_path)
    assert st is not None and contract.engine_annotation(st["state"], st["reason"]) == "failed: cuda OOM"
    with pytest.raises(ValueError):
        handoff.write_engine_state("sleeping", run_dir=tmp_path)
    assert handoff.write_engine_state("ready", run_dir=tmp_path / "f" / "x") is not None  # creates dirs
    (tmp_path / "ro").write_text("")  # a file where the run dir should be: dropped, never raised
    assert handoff.write_engine_state("ready", run_dir=tmp_path / "ro") is None


def test_wait_for_claim_returns_at_once_when_not_warm_and_on_the_claim_when_warm(tmp_path: Path) -> None:
    writer = handoff.HandoffWriter(tmp_path)
    writer.unclaimed()
    assert handoff.wait_for_claim(tmp_path, timeout=0.1) is None, "an unclaimed pod is not in service"
    writer.warm = True
    writer.fetching("abc", "uri")
    writer.ready("abc", tmp_path / "store" / "archives" / "abc")
    assert handoff.wait_for_claim(tmp_path, timeout=0.1) is None, "warm: handed off, not claimed"
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(r=handoff.wait_for_claim(tmp_path, timeout=10)))
    t.start()
    time.sleep(0.1)
    writer.in_service(1234.5)
    t.join(10)
    assert got["r"] is not None and got["r"].claimed_at == 1234.5
    status = writer.status()
    assert status is not None and status["state"] == "ready" and status["warm"] is False
    assert status["archive_dir"].endswith("abc"), "in_service keeps the hand-off"
    # A cold pod (no warm flag ever): in service as soon as anything is handed off.
    cold = handoff.HandoffWriter(tmp_path / "cold")
    cold.fetching("abc", "uri", 99.0)
    at_once = handoff.wait_for_claim(tmp_path / "cold", timeout=0.1)
    assert at_once is not None and at_once.claimed_at == 99.0 and at_once.waited_s < 0.1


def test_warm_pod_hands_off_before_the_claim_and_the_claim_puts_it_into_service(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "store")
    m = write_blob_archive(store, [4096, 100_000])
    digest = _digest(store, m.identity_hash)
    r, rep, run_dir = make(tmp_path)
    ann = bound_annotations(store, m.identity_hash, digest)
    r.on_annotations(ann, labels=WARM)
    result = handoff.wait_for_archive(run_dir, deadline=10)  # the engine gets it with no claim
    assert result.restored and result.warm and result.identity == m.identity_hash
    assert result.engine_args == ("--x", "1") and result.claimed_at == 0.0
    r.poll_engine()
    assert rep.engines == ["loading"] and r.readiness()[0] is False
    handoff.engine_ready(result)
    r.poll_engine()
    assert rep.engines == ["loading", "ready"]
    assert r.readiness() == (True, "warm: engine ready, out of service until claimed")
    assert handoff.wait_for_claim(run_dir, timeout=0.05) is None

    r.on_annotations(ann, labels=WARM)  # a repeated watch event of the warm pod changes nothing
    assert handoff.wait_for_claim(run_dir, timeout=0.05) is None
    stamp = time.time()
    claimed = {**ann, contract.ANN_CLAIMED_AT: contract.format_claimed_at(stamp)}
    r.on_annotations(claimed, labels=SERVING)
    got = handoff.wait_for_claim(run_dir, timeout=5)
    assert got is not None and got.claimed_at == pytest.approx(stamp, abs=1e-3)
    assert r.readiness() == (True, "engine ready")
    assert r.current is not None and r.current.handed_off_at is not None
    assert rep.results == [], "no second fetch or restore result from the claim itself"


def test_failed_engine_turns_readiness_off_and_is_reported(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    m = write_blob_archive(store, [4096])
    r, rep, run_dir = make(tmp_path)
    # Another identity's state file (left by an earlier claim) says nothing about this engine.
    handoff.write_engine_state("ready", identity="0" * 64, run_dir=run_dir)
    ann = bound_annotations(store, m.identity_hash, _digest(store, m.identity_hash))
    r.on_annotations(ann, labels=WARM)
    result = handoff.wait_for_archive(run_dir, deadline=10)
    r.poll_engine()
    assert r.engine_value() == "loading" and r.readiness()[0] is False
    handoff.engine_ready(result)
    r.poll_engine()
    handoff.engine_failed("engine process exited (signal 9)", result)
    r.poll_engine()
    assert rep.engines[-1] == "failed: engine process exited (signal 9)"
    assert r.readiness() == (False, "engine failed: engine process exited (signal 9)")
    assert rep.engines == ["loading", "ready", "failed: engine process exited (signal 9)"]


def test_a_restarted_engine_is_not_ready_until_it_says_so_again(tmp_path: Path) -> None:
    """The engine container restarts (a crash, an OOM kill) after it was ready: its new process
    says `loading`, and readiness goes off until it reports ready again, so no request is routed
    to an engine that is still loading."""
    store = LocalStore(tmp_path / "store")
    m = write_blob_archive(store, [4096])
    r, rep, run_dir = make(tmp_path)
    ann = bound_annotations(store, m.identity_hash, _digest(store, m.identity_hash))
    claimed = {**ann, contract.ANN_CLAIMED_AT: contract.format_claimed_at(time.time())}
    r.on_annotations(claimed, labels=SERVING)
    result = handoff.wait_for_archive(run_dir, deadline=10)
    handoff.engine_ready(result)
    handoff.report("ready", 1.0, run_dir=run_dir)
    r.poll_engine()
    assert r.readiness() == (True, "engine ready")
    handoff.engine_loading(result)  # the restarted engine's first word
    r.poll_engine()
    assert r.engine_value() == "loading" and r.readiness() == (False, "claimed: restore in progress")
    handoff.engine_ready(result)
    handoff.report("ready", 1.0, run_dir=run_dir)
    r.poll_engine()
    assert r.readiness() == (True, "engine ready")
    assert rep.engines == ["ready", "loading", "ready"]


def _digest(store: LocalStore, identity: str) -> str:
    manifest = store.get_manifest(identity)
    assert manifest is not None
    return hashlib.sha256(manifest).hexdigest()
