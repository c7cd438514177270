"""The operator's probe of a store: is the archive's manifest there, and what is it.

Used by the GraphArchive reconcile on every pass (also once Available: a deleted or replaced
manifest is noticed); the namespace's right to the store is checked before (`tenancy.py`).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from ember_operator.archive_planning import ManifestInfo, StoreProbe

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
            raise ManifestError(f"it is the manifest of identity {manifest.identity_hash[:16]}…, "
                                f"not {identity_hash[:16]}…")
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
