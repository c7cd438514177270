"""Signed archives (ember/archive/signing.py, bundle): ed25519 over the manifest's exact bytes,
stored beside it; readers with trusted keys refuse unsigned, forged or foreign-key archives before
reading any blob; several trusted keys rotate; no trust list → not checked, `ember verify` says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ember.archive import bundle, signing
from ember.cli import app
from ember.identity import ArchiveIdentity, CompatKey
from ember.store import LocalStore
from ember_sidecar.fetching import ArchiveCache, FetchFailed
from ember_testing.synthetic import synthetic_graphset, synthetic_images

IDENTITY = ArchiveIdentity(model="ember-workload/test", engine="ember-decode", engine_version="0.1.0",
                           capture_sizes=(1, 2))
COMPAT = CompatKey(gpu_name="NVIDIA H100", compute_capability="9.0", driver="580", cuda="13.0")
KEY, OTHER = signing.Ed25519PrivateKey.generate(), signing.Ed25519PrivateKey.generate()


def _trust(key: signing.Ed25519PrivateKey) -> str:
    """EMBER_TRUSTED_KEYS as the sidecar reads it."""
    return signing.trusted_keys_json([("k", signing.public_key_text(key))])


def trusted(*keys: signing.Ed25519PrivateKey) -> list[signing.TrustedKey]:
    return signing.parse_trusted_keys(
        signing.trusted_keys_json([(f"key-{i}", signing.public_key_text(k)) for i, k in enumerate(keys)]))


def save(store: LocalStore, key: signing.Ed25519PrivateKey | None) -> bundle.PublishedArchive:
    return bundle.write_archive(store, synthetic_graphset(graphs=3, nodes=20, groups=1), IDENTITY, COMPAT,
                                kernel_images=synthetic_images(), alloc_log=b"log", signing_key=key)


def archive_dir(store: LocalStore) -> Path:
    return store.root / "archives" / IDENTITY.hash()


# ---- the signing module alone ---------------------------------------------------------------------


def test_sign_verify_round_trip_and_tampered_byte() -> None:
    data = b'{"kind": "ember.dev/manifest", "blobs": []}\n'
    sig = signing.sign(data, KEY)
    assert json.loads(sig)["keyId"] == signing.key_id(KEY.public_key())
    assert signing.verify(data, sig, trusted(KEY)).name == "key-0"
    for i in (0, len(data) // 2, len(data) - 1):
        tampered = bytearray(data)
        tampered[i] ^= 0x01
        with pytest.raises(signing.SignatureError, match="does not match the manifest"):
            signing.verify(bytes(tampered), sig, trusted(KEY))


def test_wrong_key_unsigned_and_malformed_are_refused() -> None:
    data = b"manifest bytes"
    with pytest.raises(signing.SignatureError, match="does not trust"):
        signing.verify(data, signing.sign(data, OTHER), trusted(KEY))
    with pytest.raises(signing.SignatureError, match="unsigned"):
        signing.verify(data, None, trusted(KEY))
    with pytest.raises(signing.SignatureError, match=r"malformed|not an ember"):
        signing.verify(data, b"{not json", trusted(KEY))
    # a signature file naming a trusted key id but made by another key
    forged = json.loads(signing.sign(data, OTHER))
    forged["keyId"] = signing.key_id(KEY.public_key())
    with pytest.raises(signing.SignatureError, match="does not match"):
        signing.verify(data, json.dumps(forged).encode(), trusted(KEY))


def test_rotation_two_trusted_keys_accept_either() -> None:
    data = b"manifest"
    both = trusted(OTHER, KEY)
    assert signing.verify(data, signing.sign(data, KEY), both).name == "key-1"
    assert signing.verify(data, signing.sign(data, OTHER), both).name == "key-0"


def test_key_forms_and_unreadable_trust_lists() -> None:
    pem = KEY.public_key().public_bytes(signing.serialization.Encoding.PEM,
                                        signing.serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    raw = signing.public_key_text(KEY)
    keys = signing.parse_trusted_keys(json.dumps([pem, {"id": "ci", "publicKey": raw}]))
    assert {k.key_id for k in keys} == {signing.key_id(KEY.public_key())}
    assert signing.parse_trusted_keys("") == []
    for bad in ("not json", '{"a": 1}', '["AAAA"]', '[{"id": "x"}]'):
        with pytest.raises(signing.SigningKeyError):
            signing.parse_trusted_keys(bad)
    with pytest.raises(signing.SigningKeyError, match="not an unencrypted PEM"):
        signing.load_private_key(b"junk")


# ---- archives in a store ---------------------------------------------------------------------------


def test_signed_archive_signature_beside_manifest_and_verified(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    result = save(store, KEY)
    assert result.signed_by == signing.key_id(KEY.public_key())
    sig = (archive_dir(store) / "manifest.sig").read_bytes()
    manifest = (archive_dir(store) / "manifest").read_bytes()
    signing.verify(manifest, sig, trusted(KEY))
    assert bundle.read_archive(store, IDENTITY.hash(), trusted_keys=trusted(OTHER, KEY)).alloc_log == b"log"
    # the sidecar's copy keeps the signed bytes and the signature: LOAD verifies the cache again
    cache = ArchiveCache(tmp_path / "cache", trusted_keys=_trust(KEY))
    cache.fetch(store.manifest_uri(IDENTITY.hash()), IDENTITY.hash())
    assert bundle.open_archive(cache.local, IDENTITY.hash(), trusted_keys=trusted(KEY))
    assert store.delete_archive(IDENTITY.hash()) and not archive_dir(store).exists()


def test_unsigned_or_forged_archive_refused_before_any_blob_when_trust_is_configured(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    save(store, None)
    for p in (store.root / "blobs").rglob("*"):
        if p.is_file():
            p.unlink()  # reading any blob would now fail with ArchiveMissing, not ArchiveUntrusted
    with pytest.raises(bundle.ArchiveUntrusted, match="unsigned"):
        bundle.open_archive(store, IDENTITY.hash(), trusted_keys=trusted(KEY))
    with pytest.raises(FetchFailed, match=r"signature-refused.*unsigned"):  # the sidecar's fetch
        ArchiveCache(tmp_path / "cache", trusted_keys=_trust(KEY)).fetch(
            store.manifest_uri(IDENTITY.hash()), IDENTITY.hash())
    assert not list((tmp_path / "cache").rglob("blobs/*"))
    assert bundle.open_archive(store, IDENTITY.hash())  # no trust list: today's behaviour

    signed = LocalStore(tmp_path / "signed")
    save(signed, KEY)
    m = archive_dir(signed) / "manifest"
    m.write_bytes(m.read_bytes().replace(b'"log"', b'"lOg"').replace(b"{", b"{ ", 1))
    problems = bundle.verify_archive(signed, IDENTITY.hash(), trusted_keys=trusted(KEY))
    assert len(problems) == 1 and "does not match the manifest" in problems[0]


def test_ember_verify_reports_signatures(tmp_path: Path) -> None:
    runner = CliRunner()
    unsigned, signed = LocalStore(tmp_path / "u"), LocalStore(tmp_path / "s")
    save(unsigned, None)
    save(signed, KEY)
    key = signing.public_key_text(KEY)

    out = runner.invoke(app, ["verify", unsigned.uri])
    assert out.exit_code == 0 and "signature: unsigned" in out.output, out.output
    out = runner.invoke(app, ["verify", signed.uri])
    assert out.exit_code == 0 and "not checked" in out.output, out.output
    out = runner.invoke(app, ["verify", signed.uri, "--trusted-key", key])
    assert out.exit_code == 0 and "verified" in out.output, out.output
    out = runner.invoke(app, ["verify", unsigned.uri, "--trusted-key", key])
    assert out.exit_code != 0 and "unsigned" in out.output, out.output
    out = runner.invoke(app, ["verify", signed.uri, "--trusted-key", signing.public_key_text(OTHER)])
    assert out.exit_code != 0 and "does not trust" in out.output, out.output
