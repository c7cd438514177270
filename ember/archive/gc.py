"""Garbage collection in a store: blobs that no archive's manifest names any more.

Blobs are shared between archives (content-addressed), so deleting an archive deletes only its
manifest (`Store.delete_archive`); what is left over is found here. It reads manifests, which is
why it lives with the archive format and not in ember/store (the store knows bytes, not archives).
"""

from __future__ import annotations

import time

from ember.archive.manifest import referenced_digests
from ember.store import Store


def referenced_blobs(store: Store) -> set[str]:
    """Digests named by any manifest in the store."""
    refs: set[str] = set()
    for identity_hash in store.list_archives():
        data = store.get_manifest(identity_hash)
        if data is not None:
            refs |= referenced_digests(data)
    return refs


def unreferenced_blobs(store: Store, min_age_s: float = 3600.0) -> list[str]:
    """Blobs no manifest names and older than `min_age_s` (a SAVE uploads blobs before its
    manifest, so young blobs may belong to an archive being written)."""
    refs = referenced_blobs(store)
    now = time.time()
    return sorted(
        b.digest for b in store.iter_blobs() if b.digest not in refs and now - b.modified >= min_age_s
    )
