"""Garbage collection in a store: blobs that no archive's manifest names any more.

Blobs are shared between archives (content-addressed), so deleting an archive deletes only its
manifest (`Store.delete_archive`); what is left over is found here. It reads manifests, which is
why it lives with the archive format and not in ember/store (the store knows bytes, not archives).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from ember.archive.manifest import referenced_digests
from ember.identity import identity_short
from ember.store import BlobInfo, Store


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


class GcRefused(Exception):
    """Collecting would risk an archive that is kept (its blobs cannot be told)."""


@dataclass
class GcPlan:
    """What `ember gc` deletes: manifests of archives nobody keeps, then blobs no kept archive
    names. `held` says why blobs are left alone although unreferenced (an identity being saved
    into this store: its SAVE may be writing a manifest that names blobs already stored)."""

    archives: list[str] = field(default_factory=list)
    blobs: list[BlobInfo] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    young: int = 0  # unreferenced blobs left because they are younger than min_age_s
    held: str = ""

    @property
    def blob_bytes(self) -> int:
        return sum(b.size for b in self.blobs)


def is_kept(identity_hash: str, keep: set[str]) -> bool:
    """`keep` holds identity hashes and identity shorts (the `ember.dev/identity` label)."""
    return identity_hash in keep or identity_short(identity_hash) in keep


def plan_gc(
    store: Store, keep: set[str], min_age_s: float = 3600.0, saving: set[str] | None = None,
) -> GcPlan:
    """Archives of `store` not in `keep`, and the blobs only they (or nothing) name.

    A blob named by any kept archive is never collected, whichever archives also name it; a kept
    archive whose manifest cannot be read refuses the whole plan (its blobs are unknown); blobs
    younger than `min_age_s` stay (a SAVE uploads blobs before its manifest), and no blob goes
    while an identity of `saving` (being saved into this store) has no manifest yet."""
    plan = GcPlan()
    kept_refs: set[str] = set()
    for identity_hash in store.list_archives():
        if not is_kept(identity_hash, keep):
            plan.archives.append(identity_hash)
            continue
        plan.kept.append(identity_hash)
        data = store.get_manifest(identity_hash)
        if data is None:
            continue
        try:
            raw = json.loads(data)
            kept_refs |= {b["sha256"] for b in raw["blobs"]}
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise GcRefused(f"kept archive {identity_hash} has an unreadable manifest ({exc}): "
                            "its blobs cannot be told, nothing is collected") from None
    missing = sorted(k for k in saving or set() if not any(is_kept(h, {k}) for h in plan.kept))
    if missing:
        plan.held = (f"{len(missing)} archive(s) being saved into this store (e.g. {missing[0]}): a SAVE "
                     "may write a manifest naming blobs already stored, so no blob is collected now")
        return plan
    now = time.time()
    for blob in store.iter_blobs():
        if blob.digest in kept_refs:
            continue
        if now - blob.modified < min_age_s:
            plan.young += 1
        else:
            plan.blobs.append(blob)
    plan.blobs.sort(key=lambda b: b.digest)
    return plan


def apply_gc(store: Store, plan: GcPlan) -> None:
    """Delete the plan's manifests first (an archive without its manifest is gone for readers),
    then its blobs."""
    for identity_hash in plan.archives:
        store.delete_archive(identity_hash)
    for blob in plan.blobs:
        store.delete_blob(blob.digest)
