"""The operator's probe of a store: is the archive's manifest there, and what is it.

Used by the GraphArchive reconcile on every pass (also once Available: a deleted or replaced
manifest is noticed); the namespace's right to the store is checked before (`tenancy.py`).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
from typing import Any

from ember.identity import identity_short
from ember_operator.api import GraphArchiveSpec
from ember_operator.archive_planning import ManifestInfo, StoreProbe
from ember_operator.kube import Kube, secret_path
from ember_operator.pods import StoreAccess
from ember_operator.tenancy import Tenancy, store_refusal

log = logging.getLogger("ember_operator")


def probe_store(uri: str, identity_hash: str, opts: dict[str, Any], timeout_s: float) -> StoreProbe:
    from ember.archive.manifest import ManifestError, loads
    from ember.store import StoreError, StoreUnavailable, open_store

    if uri.startswith("s3://"):
        opts = {**opts, "connect_timeout": timeout_s, "read_timeout": timeout_s, "max_attempts": 2}
    try:
        store = open_store(uri, **opts)
        data = store.get_manifest(identity_hash)
    except StoreUnavailable as exc:
        return StoreProbe(unreachable=str(exc)[:512])
    except StoreError as exc:
        return StoreProbe(unreachable=f"{type(exc).__name__}: {exc}"[:512])
    if data is None:
        return StoreProbe()
    info: dict[str, Any] = {"bytes": len(data), "graphs": None, "compat": {}}
    try:
        manifest = loads(data)
        if manifest.identity_hash != identity_hash:
            found, wanted = identity_short(manifest.identity_hash), identity_short(identity_hash)
            raise ManifestError(f"it is the manifest of identity {found}…, not {wanted}…")
        info["bytes"] = manifest.total_bytes
        info["graphs"] = manifest.graphs.count
        compat = manifest.compat.model_dump()
        info["compat"] = {
            "gpuName": compat.get("gpu_name"), "computeCapability": compat.get("compute_capability"),
            "driver": compat.get("driver"), "cuda": compat.get("cuda"), "torch": compat.get("torch"),
            "engine": compat.get("engine"),
        }
    except ManifestError as exc:
        log.warning("Manifest of %s in %s is not readable by this operator: %s", identity_hash, uri, exc)
        return StoreProbe(invalid=str(exc)[:512])
    return StoreProbe(manifest=ManifestInfo(
        uri=store.manifest_uri(identity_hash), digest=hashlib.sha256(data).hexdigest(), **info,
    ))


def probe_archive(
    kube: Kube, ns: str, spec: GraphArchiveSpec, tenancy: Tenancy, timeout_s: float
) -> StoreProbe:
    """Ask the store whether the archive's manifest exists, and what it is (also once Available: a
    manifest deleted or replaced since is noticed on the next pass). A store the namespace may
    not use is never connected to; credentials come from the spec's Secret."""
    if refusal := store_refusal(spec.store, ns, tenancy):
        return StoreProbe(refused=refusal)
    access = StoreAccess.of(spec.store)
    opts = access.open_options()
    secret_name = spec.store.credentials_secret
    if secret_name:
        secret = kube.get(secret_path(ns, secret_name))
        if secret is None:
            return StoreProbe(secret_missing=True)
        data = secret.get("data") or {}
        with contextlib.suppress(ValueError, KeyError):
            opts["access_key"] = base64.b64decode(data["AWS_ACCESS_KEY_ID"]).decode()
            opts["secret_key"] = base64.b64decode(data["AWS_SECRET_ACCESS_KEY"]).decode()
    return probe_store(access.uri, spec.identity_hash, opts, timeout_s)
