"""Store garbage collection (ember/archive/gc.py): blobs no manifest names, old enough to drop."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ember.archive.gc import referenced_blobs, unreferenced_blobs
from ember.store import LocalStore

H1 = "11" * 32


def test_unreferenced_blobs_respects_manifests_and_age(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    kept = store.put_blob(b"kept")
    orphan = store.put_blob(b"orphan")
    young = store.put_blob(b"young")
    old = time.time() - 7200
    for d in (kept, orphan):
        os.utime(store.blob_path(d), (old, old))
    store.put_manifest(H1, json.dumps({"blobs": [{"name": "x", "sha256": kept}]}).encode())
    assert unreferenced_blobs(store, min_age_s=3600) == [orphan]
    assert sorted(unreferenced_blobs(store, min_age_s=0)) == sorted([orphan, young])
    store.delete_blob(orphan)
    assert not store.has_blob(orphan)
    store.delete_archive(H1)
    assert unreferenced_blobs(store, min_age_s=3600) == [kept]


def test_referenced_blobs_reads_every_manifest_and_skips_unreadable_ones(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    a, b = store.put_blob(b"a"), store.put_blob(b"b")
    store.put_manifest(H1, json.dumps({"blobs": [{"name": "x", "sha256": a}]}).encode())
    store.put_manifest("22" * 32, json.dumps({"blobs": [{"name": "y", "sha256": b}]}).encode())
    store.put_manifest("33" * 32, b"not json")
    assert referenced_blobs(store) == {a, b}
