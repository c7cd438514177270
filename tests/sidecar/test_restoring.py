"""The restore state machine end to end on a real local store: claim → fetch → verify → handoff →
engine reports → result, and every fallback path. No Kubernetes (see tests/k8s for that)."""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from support.sidecar import RecordingReporter, sample, wait_for

from ember import handoff
from ember.store import LocalStore
from ember_sidecar.claims import Claim
from ember_sidecar.fetching import ArchiveCache, FetchFailed
from ember_sidecar.metrics import Metrics
from ember_sidecar.restoring import Restorer
from ember_testing.archives import sample_identity, write_blob_archive

SIZES = [4096, 200_000, 50_000, 1_000_000]


def make(tmp_path: Path, **kw) -> tuple[Restorer, RecordingReporter, Path]:
    run_dir = tmp_path / "run"
    writer = handoff.HandoffWriter(run_dir)
    cache = ArchiveCache(writer.cache_dir, retry_s=kw.pop("retry_s", 0.5), timeout_s=30)
    reporter = RecordingReporter()
    return Restorer(cache, writer, Metrics(), reporter, **kw), reporter, run_dir


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def claim_for(store: LocalStore, identity_hash: str) -> Claim:
    return Claim(store.manifest_uri(identity_hash), identity_hash)


def engine(run_dir: Path, out: dict, deadline: float = 10.0) -> threading.Thread:
    t = threading.Thread(target=lambda: out.update(r=handoff.wait_for_archive(run_dir, deadline=deadline)))
    t.start()
    return t


def test_claim_fetch_verify_handoff_restored(store: LocalStore, tmp_path: Path) -> None:
    m = write_blob_archive(store, SIZES)
    r, rep, run_dir = make(tmp_path)
    assert r.readiness() == (False, "warm: engine not on standby yet")
    handoff.report("standby", 3.0, run_dir=run_dir)
    r.poll_engine()
    assert r.readiness()[0], "a warm pod whose engine is on standby is claimable"

    got: dict = {}
    t = engine(run_dir, got)
    assert r.claim(claim_for(store, m.identity_hash))
    assert not r.claim(claim_for(store, m.identity_hash)), "a repeated watch event is not a new claim"
    t.join(10)
    res = got["r"]
    assert res.restored and res.identity == m.identity_hash
    assert r.readiness() == (False, "claimed: restore in progress")
    # Every blob in the cache, byte-identical to the store's.
    for b in m.blobs:
        assert res.blob_path(b.sha256).read_bytes() == store.get_blob_bytes(b.sha256)
    assert LocalStore(run_dir / "store").get_manifest(m.identity_hash) == store.get_manifest(m.identity_hash)

    with handoff.load_attempt(res):
        handoff.report("compat", 0.01, run_dir=run_dir)
        handoff.report("load", 0.2, run_dir=run_dir)
    handoff.report("first_token", 0.05, run_dir=run_dir)
    handoff.report("ready", 0.0, run_dir=run_dir)
    r.poll_engine()
    assert r.readiness() == (True, "engine ready")
    assert rep.results == ["restored"]
    assert rep.events[-1][:2] == ("Normal", "Restored")
    met = r.metrics
    for stage in ("claim_to_fetch", "fetch", "verify", "handoff", "compat", "load", "first_token"):
        assert sample(met, "ember_restore_stage_seconds_count", stage=stage) == 1, stage
    assert sample(met, "ember_restore_stage_seconds_sum", stage="load") == pytest.approx(0.2)
    assert sample(met, "ember_restores_total", result="restored", reason="") == 1
    assert sample(met, "ember_restores_total", result="fallback", reason="digest-mismatch") == 0


def test_cached_archive_is_not_fetched_again(store: LocalStore, tmp_path: Path) -> None:
    m = write_blob_archive(store, SIZES)
    r, _, run_dir = make(tmp_path)
    r.claim(claim_for(store, m.identity_hash))
    assert handoff.wait_for_archive(run_dir, deadline=10).restored
    r.stop()
    # The sidecar container restarts: the store's blobs are gone, the cache still serves.
    for b in m.blobs:
        store.delete_blob(b.sha256)
    r2, rep2, _ = make(tmp_path)
    r2.claim(claim_for(store, m.identity_hash))
    wait_for(lambda: (r2.writer.status() or {}).get("state") == "ready", what="cached handoff")
    assert sample(r2.metrics, "ember_restore_stage_seconds_sum", stage="fetch") == 0.0
    assert rep2.results == []


def test_corrupted_blob_falls_back(store: LocalStore, tmp_path: Path) -> None:
    m = write_blob_archive(store, SIZES)
    victim = store.root / "blobs" / m.blobs[2].sha256
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    r, rep, run_dir = make(tmp_path)
    got: dict = {}
    t = engine(run_dir, got)
    r.claim(claim_for(store, m.identity_hash))
    t.join(10)
    assert not got["r"].restored and got["r"].reason.startswith("digest-mismatch")
    wait_for(lambda: rep.events, what="the Warning event")
    assert rep.results[-1].startswith("fallback: digest-mismatch")
    assert rep.events[-1][0:2] == ("Warning", "RestoreFallback") and rep.events[-1][3] is True
    assert sample(r.metrics, "ember_restores_total", result="fallback", reason="digest-mismatch") == 1
    assert not (run_dir / "store" / "archives" / m.identity_hash / "manifest").exists()
    # The poller keeps running, nothing is counted twice.
    r.poll_engine()
    assert sample(r.metrics, "ember_restores_total", result="fallback", reason="digest-mismatch") == 1


def test_wrong_identity_falls_back(store: LocalStore, tmp_path: Path) -> None:
    claimed = sample_identity("claimed").hash()
    write_blob_archive(store, SIZES, identity=sample_identity("other"), manifest_identity_hash=claimed)
    r, _rep, run_dir = make(tmp_path)
    r.claim(claim_for(store, claimed))
    res = handoff.wait_for_archive(run_dir, deadline=10)
    assert not res.restored and res.reason.startswith("identity-mismatch")
    assert sample(r.metrics, "ember_restores_total", result="fallback", reason="identity-mismatch") == 1


def test_missing_archive_and_bad_claim_fall_back(store: LocalStore, tmp_path: Path) -> None:
    r, _rep, run_dir = make(tmp_path)
    r.claim(claim_for(store, sample_identity("nothing").hash()))
    res = handoff.wait_for_archive(run_dir, deadline=10)
    assert not res.restored and res.reason.startswith("archive-missing")

    r2, _rep2, run_dir2 = make(tmp_path / "b")
    bad = {"ember.dev/archive": "s3://b/p/archives/" + "ab" * 32 + "/manifest",
           "ember.dev/identity": "cd" * 32}
    r2.on_annotations(bad)
    r2.on_annotations(bad)  # the same bad claim seen again is not a second fallback
    res = handoff.wait_for_archive(run_dir2, deadline=5)
    assert not res.restored and res.reason.startswith("identity-mismatch")
    assert sample(r2.metrics, "ember_restores_total", result="fallback", reason="identity-mismatch") == 1


def test_store_unavailable_falls_back_after_retries(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # An S3 endpoint nobody listens on: botocore retries, then the sidecar's own retry budget.
    # The budget counts from the first attempt, whose client set-up alone can take a second on a
    # loaded CI machine: 3 s leaves room for at least one retry there.
    r, _rep, run_dir = make(tmp_path, retry_s=3.0)
    r.cache.store_options = {"endpoint": "http://127.0.0.1:9", "max_attempts": 1, "connect_timeout": 0.2,
                             "access_key": "x", "secret_key": "y"}
    h = "ab" * 32
    t0 = time.monotonic()
    r.claim(Claim(f"s3://nobucket/p/archives/{h}/manifest", h))
    res = handoff.wait_for_archive(run_dir, deadline=20)
    assert not res.restored and res.reason.startswith("store-unavailable")
    assert time.monotonic() - t0 >= 0.25, "backed off before giving up"
    assert any("retrying" in r.getMessage() for r in caplog.records), "retried before giving up"
    assert sample(r.metrics, "ember_restores_total", result="fallback", reason="store-unavailable") == 1


def test_engine_compat_mismatch_is_a_fallback(store: LocalStore, tmp_path: Path) -> None:
    m = write_blob_archive(store, SIZES)
    r, rep, run_dir = make(tmp_path)
    r.claim(claim_for(store, m.identity_hash))
    res = handoff.wait_for_archive(run_dir, deadline=10)
    assert res.restored
    reason = "compat-mismatch: driver: archive='580' here='575'"
    handoff.report("compat", 0.01, "fallback", reason, run_dir=run_dir)
    handoff.report("capture", 12.0, run_dir=run_dir)
    handoff.report("ready", 0.0, run_dir=run_dir)
    r.poll_engine()
    assert rep.results == ["fallback: compat-mismatch: driver: archive='580' here='575'"]
    assert sample(r.metrics, "ember_restores_total", result="fallback", reason="compat-mismatch") == 1
    assert sample(r.metrics, "ember_restore_stage_seconds_count", stage="capture") == 1
    assert r.readiness()[0]
    # An engine restart now captures instead of trying the archive again.
    assert not handoff.wait_for_archive(run_dir, deadline=1).restored


def test_engine_crash_during_load_is_reported_as_fallback(store: LocalStore, tmp_path: Path) -> None:
    m = write_blob_archive(store, SIZES)
    r, rep, run_dir = make(tmp_path)
    r.claim(claim_for(store, m.identity_hash))
    res = handoff.wait_for_archive(run_dir, deadline=10)
    # What a segfault inside load_attempt leaves behind:
    handoff.write_json_atomic(run_dir / handoff.MARKER_FILE, {"identity": res.identity})
    again = handoff.wait_for_archive(run_dir, deadline=1)  # the restarted engine
    assert not again.restored
    r.poll_engine()
    assert rep.results[-1].startswith(f"fallback: {handoff.REASON_CRASHED}")
    assert sample(r.metrics, "ember_restores_total", result="fallback", reason=handoff.REASON_CRASHED) == 1


def test_engine_timeout_after_handoff(store: LocalStore, tmp_path: Path) -> None:
    m = write_blob_archive(store, SIZES)
    r, rep, _run_dir = make(tmp_path, engine_timeout_s=0.2)
    r.claim(claim_for(store, m.identity_hash))
    wait_for(lambda: (r.writer.status() or {}).get("state") == "ready", what="handoff")
    time.sleep(0.3)
    r.poll_engine()
    assert rep.results[-1].startswith("fallback: engine-timeout")


def test_prefetch_then_claim_pays_no_download(store: LocalStore, tmp_path: Path) -> None:
    m = write_blob_archive(store, SIZES)
    other = write_blob_archive(store, [1000, 2000], identity=sample_identity("other"), seed=1)
    r, _rep, run_dir = make(tmp_path)
    uris = f"{store.manifest_uri(m.identity_hash)},{store.manifest_uri(other.identity_hash)}"
    r.on_annotations({"ember.dev/prefetch": uris})
    wait_for(lambda: sample(r.metrics, "ember_prefetches_total", result="ok") == 2, what="prefetches")
    for b in m.blobs:  # prove the claim does not touch the store
        store.delete_blob(b.sha256)
    manifest = store.get_manifest(m.identity_hash) or b""
    r.on_annotations({"ember.dev/archive": store.manifest_uri(m.identity_hash),
                      "ember.dev/identity": m.identity_hash,
                      "ember.dev/manifest-digest": hashlib.sha256(manifest).hexdigest()})
    assert handoff.wait_for_archive(run_dir, deadline=10).restored
    assert sample(r.metrics, "ember_restore_stage_seconds_sum", stage="fetch") == 0.0


def test_stop_removes_partial_files(tmp_path: Path) -> None:
    r, _, run_dir = make(tmp_path)
    blobs = run_dir / "store" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / (".ab" * 10 + ".part")).write_bytes(b"x")
    (blobs / ".cd.part.a1b2c3").write_bytes(b"x")  # s3transfer's own temporary name
    (blobs / ("ef" * 32)).write_bytes(b"kept")
    assert r.stop() == 2
    assert [p.name for p in blobs.iterdir()] == ["ef" * 32]
    assert r.readiness() == (False, "stopping")


def test_truncated_blob_is_a_size_mismatch(store: LocalStore, tmp_path: Path) -> None:
    m = write_blob_archive(store, SIZES)
    victim = store.root / "blobs" / m.blobs[1].sha256
    victim.write_bytes(victim.read_bytes()[:-10])
    r, _, run_dir = make(tmp_path)
    r.claim(claim_for(store, m.identity_hash))
    res = handoff.wait_for_archive(run_dir, deadline=10)
    assert not res.restored and res.reason.startswith("size-mismatch") and "truncated" in res.reason


def test_bundle_archive_handed_off_and_opened_from_cache(store: LocalStore, tmp_path: Path) -> None:
    from ember.archive.bundle import open_archive, verify_archive
    from ember_testing.archives import write_bundle_archive

    m = write_bundle_archive(store, 2.0)
    r, _, run_dir = make(tmp_path)
    r.claim(claim_for(store, m.identity_hash))
    res = handoff.wait_for_archive(run_dir, deadline=20)
    assert res.restored
    # What the engine does with the handoff: open the cache as a store, by identity.
    assert verify_archive(res.store_uri, res.identity, expected_identity=m.identity) == []
    archive = open_archive(res.store_uri, res.identity)
    assert archive.graph_table.keys == open_archive(store, m.identity_hash).graph_table.keys
    assert archive.manifest.engine == {"kv_cache_bytes": 1 << 30}


def test_claim_is_not_held_up_by_a_stuck_prefetch(store: LocalStore, tmp_path: Path) -> None:
    import socket

    m = write_blob_archive(store, SIZES)
    r, _, run_dir = make(tmp_path)
    # An S3 endpoint that accepts connections and never answers: the prefetch hangs in its GET.
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        r.cache.store_options = {"endpoint": f"http://127.0.0.1:{silent.getsockname()[1]}", "max_attempts": 1,
                                 "read_timeout": 1.0, "access_key": "x", "secret_key": "y"}
        r.prefetch(f"s3://bucket/p/archives/{'cd' * 32}/manifest")
        time.sleep(0.2)
        t0 = time.monotonic()
        r.claim(claim_for(store, m.identity_hash))
        assert handoff.wait_for_archive(run_dir, deadline=10).restored
        assert time.monotonic() - t0 < 0.9, "the claim did not wait for the prefetch"
        assert r._prefetch_cancel["cd" * 32].is_set(), "a claim cancels prefetches of other archives"
        wait_for(lambda: not any(t.is_alive() for t in r._workers if t.name == "ember-prefetch"),
                 what="the prefetch to end")
        assert sample(r.metrics, "ember_prefetches_total", result="ok") == 0
    finally:
        silent.close()


def test_claim_clock_starts_at_the_operators_stamp(store: LocalStore, tmp_path: Path) -> None:
    m = write_blob_archive(store, SIZES)
    r, _, run_dir = make(tmp_path)
    stamp = time.time() - 0.3
    r.claim(Claim(store.manifest_uri(m.identity_hash), m.identity_hash, claimed_at=stamp))
    assert handoff.wait_for_archive(run_dir, deadline=10).restored
    assert r.writer.status()["claimed_at"] == stamp  # the engine's claim → first token clock
    assert sample(r.metrics, "ember_restore_stage_seconds_sum", stage="claim_to_fetch") >= 0.3
    # A stale stamp (a restarted sidecar re-reading an old claim) is not used.
    r2, _, _ = make(tmp_path / "b")
    r2.claim(Claim(store.manifest_uri(m.identity_hash), m.identity_hash, claimed_at=time.time() - 3600))
    wait_for(lambda: sample(r2.metrics, "ember_restore_stage_seconds_count", stage="claim_to_fetch") == 1)
    assert sample(r2.metrics, "ember_restore_stage_seconds_sum", stage="claim_to_fetch") < 60


def test_manifest_other_than_the_pinned_digest_is_refused(store: LocalStore, tmp_path: Path) -> None:
    """Cached or fetched, a manifest whose sha256 is not the claim's pin is not restored."""
    m = write_blob_archive(store, SIZES)
    pinned = hashlib.sha256(store.get_manifest(m.identity_hash) or b"").hexdigest()
    r, _rep, run_dir = make(tmp_path)
    r.claim(replace(claim_for(store, m.identity_hash), manifest_digest="0" * 64))
    res = handoff.wait_for_archive(run_dir, deadline=10)
    assert not res.restored and res.reason.startswith("manifest-digest-mismatch"), res.reason
    reason = "manifest-digest-mismatch"
    assert sample(r.metrics, "ember_restores_total", result="fallback", reason=reason) == 1
    # The pinned digest restores; once cached, a claim pinning another digest is still refused.
    r2, _rep2, run_dir2 = make(tmp_path / "b")
    r2.claim(replace(claim_for(store, m.identity_hash), manifest_digest=pinned))
    assert handoff.wait_for_archive(run_dir2, deadline=10).restored
    with pytest.raises(FetchFailed, match="manifest-digest-mismatch"):
        r2.cache.fetch(store.manifest_uri(m.identity_hash), m.identity_hash, digest="1" * 64)


def test_multi_rank_pod_is_restored_when_every_rank_loaded(store: LocalStore, tmp_path: Path) -> None:
    """A pod of 4 GPUs: every rank gets the same archive and the layout (rank 0 of world 4 is the
    pod's first rank); the restore result waits for a LOAD report of each of the 4 ranks."""
    m = write_blob_archive(store, SIZES)
    r, rep, run_dir = make(tmp_path)
    r.claim(replace(claim_for(store, m.identity_hash), world=4))
    results = [handoff.wait_for_archive(run_dir, deadline=10) for _ in range(4)]
    assert all(res.restored and (res.rank, res.world) == (0, 4) for res in results)
    assert len({res.archive_dir for res in results}) == 1
    for rank in range(3):
        handoff.report("load", 0.2, run_dir=run_dir, rank=rank)
        handoff.report("load", 0.2, run_dir=run_dir, rank=rank)  # a repeated report is one rank
    r.poll_engine()
    assert rep.results == [], "3 of 4 ranks loaded: not restored yet"
    handoff.report("load", 0.2, run_dir=run_dir, rank=3)
    r.poll_engine()
    assert rep.results == ["restored"]


def test_multi_gpu_pod_with_one_rankless_engine_is_restored(store: LocalStore, tmp_path: Path) -> None:
    """A 2-GPU replica served by one engine process (ember serve, vLLM): its `load ok` report has no
    rank, and it alone means the pod restored; no engine-timeout fallback follows."""
    m = write_blob_archive(store, SIZES)
    r, rep, run_dir = make(tmp_path, engine_timeout_s=0.2)
    r.claim(replace(claim_for(store, m.identity_hash), world=2))
    res = handoff.wait_for_archive(run_dir, deadline=10)
    assert res.restored and (res.rank, res.world) == (0, 2)
    handoff.report("load", 0.2, run_dir=run_dir)
    r.poll_engine()
    assert rep.results == ["restored"]
    time.sleep(0.3)  # past engine_timeout_s
    r.poll_engine()
    assert rep.results == ["restored"]
    assert rep.events[-1][:2] == ("Normal", "Restored")
    assert sample(r.metrics, "ember_restores_total", result="restored", reason="") == 1
    assert sample(r.metrics, "ember_restores_total", result="fallback", reason="engine-timeout") == 0


def test_drain_annotation_turns_readiness_off_and_back(store: LocalStore, tmp_path: Path) -> None:
    m = write_blob_archive(store, SIZES)
    r, _rep, run_dir = make(tmp_path)
    claim = claim_for(store, m.identity_hash)
    r.on_annotations(claim.annotations())
    handoff.report("ready", 0.0, run_dir=run_dir)
    r.poll_engine()
    assert r.readiness() == (True, "engine ready")
    r.on_annotations({**claim.annotations(), "ember.dev/drain-at": "2026-11-24T16:00:00.000000Z"})
    assert r.readiness()[0] is False and r.readiness()[1].startswith("draining")
    r.on_annotations(claim.annotations())  # the operator took it back (an edit back mid-switch)
    assert r.readiness() == (True, "engine ready")
