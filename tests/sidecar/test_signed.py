"""The sidecar with a trust list (EMBER_TRUSTED_KEYS): a signed archive is fetched and handed over
with its signature in the cache; an unsigned or forged one falls back to native capture with the
reason, a Warning event and the metric, before any blob is fetched."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.sidecar import RecordingReporter, sample, wait_for

from ember import handoff
from ember.archive import bundle, signing
from ember.store import LocalStore
from ember_sidecar.claims import Claim
from ember_sidecar.fetching import ArchiveCache
from ember_sidecar.metrics import Metrics
from ember_sidecar.restoring import Restorer
from ember_sidecar.settings import Settings
from ember_testing.archives import write_bundle_archive

KEY, OTHER = signing.Ed25519PrivateKey.generate(), signing.Ed25519PrivateKey.generate()


def trust(*keys: signing.Ed25519PrivateKey) -> str:
    return signing.trusted_keys_json([(f"k{i}", signing.public_key_text(k)) for i, k in enumerate(keys)])


def restorer(tmp_path: Path, trusted: str) -> tuple[Restorer, RecordingReporter, Path]:
    run_dir = tmp_path / "run"
    writer = handoff.HandoffWriter(run_dir)
    opts = Settings.from_env(trusted_keys=trusted).cache_options()  # the env → cache path
    cache = ArchiveCache(writer.cache_dir, retry_s=0.5, timeout_s=30, trusted_keys=opts["trusted_keys"])
    reporter = RecordingReporter()
    return Restorer(cache, writer, Metrics(), reporter), reporter, run_dir


def signed_store(tmp_path: Path, key: signing.Ed25519PrivateKey | None) -> tuple[LocalStore, str]:
    store = LocalStore(tmp_path / "store")
    m = write_bundle_archive(store, 1.0)
    if key is not None:  # sign the manifest as SAVE would (its exact stored bytes)
        store.put_signature(m.identity_hash, signing.sign(store.get_manifest(m.identity_hash), key))
    return store, m.identity_hash


def test_signed_archive_is_handed_over_with_its_signature(tmp_path: Path) -> None:
    store, ident = signed_store(tmp_path, KEY)
    r, rep, run_dir = restorer(tmp_path, trust(OTHER, KEY))
    r.claim(Claim(store.manifest_uri(ident), ident))
    res = handoff.wait_for_archive(run_dir, deadline=20)
    assert res.restored, res.reason
    # the engine's LOAD can verify the cached copy again
    assert bundle.open_archive(res.store_uri, ident, trusted_keys=signing.parse_trusted_keys(trust(KEY)))
    assert rep.results == []


@pytest.mark.parametrize("case", ["unsigned", "wrong-key", "forged"])
def test_untrusted_archive_falls_back_before_any_blob(tmp_path: Path, case: str) -> None:
    signer = {"unsigned": None, "wrong-key": OTHER, "forged": KEY}[case]
    store, ident = signed_store(tmp_path, signer)
    if case == "forged":  # the bucket's manifest altered after signing
        path = store.root / "archives" / ident / "manifest"
        path.write_bytes(path.read_bytes().replace(b"{", b"{ ", 1))
    r, rep, run_dir = restorer(tmp_path, trust(KEY))
    r.claim(Claim(store.manifest_uri(ident), ident))
    res = handoff.wait_for_archive(run_dir, deadline=20)
    assert not res.restored and res.reason.startswith("signature-refused"), res.reason
    want = {"unsigned": "unsigned", "wrong-key": "does not trust", "forged": "does not match"}[case]
    assert want in res.reason
    wait_for(lambda: rep.events, what="the Warning event")
    assert rep.results[-1].startswith("fallback: signature-refused")
    assert rep.events[-1][:2] == ("Warning", "RestoreFallback")
    assert sample(r.metrics, "ember_restores_total", result="fallback", reason="signature-refused") == 1
    assert not list((run_dir / "store").glob("blobs/*"))  # no blob was fetched


def test_unreadable_trust_list_refuses_rather_than_trusting_everything(tmp_path: Path) -> None:
    store, ident = signed_store(tmp_path, KEY)
    r, _rep, run_dir = restorer(tmp_path, "[not json")
    r.claim(Claim(store.manifest_uri(ident), ident))
    res = handoff.wait_for_archive(run_dir, deadline=20)
    assert not res.restored and "trusted keys cannot be read" in res.reason
