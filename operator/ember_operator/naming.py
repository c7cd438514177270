"""Deterministic names of the objects the operator creates.

Every name is a pure function of the spec, so a restarted operator finds what it created before
instead of creating a second one. Label and annotation keys are the pod contract's (`ember.contract`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ember import contract
from ember.identity import identity_short


def short_hash(*parts: Any, length: int = 10) -> str:
    data = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(data).hexdigest()[:length]


def archive_name(identity_hash: str) -> str:
    """GraphArchive name: `ga-<identity short>` (the identity hash's first 16 hex)."""
    return f"ga-{identity_short(identity_hash)}"


def save_job_name(identity_hash: str, attempt: int) -> str:
    """SAVE Job name, deterministic per identity and attempt (a retry is a new attempt)."""
    return f"ember-save-{identity_short(identity_hash)}-{attempt}"


def hpa_name(md_name: str) -> str:
    return f"{md_name}-ember"


def serving_pod_name(md_name: str, revision: str, index: int) -> str:
    return f"{md_name}-{revision[:8]}-{index}"


def warm_pod_prefix(pool_key: str) -> str:
    return f"ember-warm-{pool_key[:10]}-"


def warm_pod_names(pool_key: str, taken: set[str], count: int) -> list[str]:
    """The `count` lowest-numbered warm pod names of a pool not in `taken` (names of the pods that
    exist). Deterministic, so two writers topping a pool up pick the same names and the apiserver
    refuses the second (409) instead of both adding pods, as generateName would."""
    names: list[str] = []
    i = 0
    while len(names) < count:
        name = f"{warm_pod_prefix(pool_key)}{i}"
        if name not in taken:
            names.append(name)
        i += 1
    return names


def warm_selector(pool_key: str = "") -> str:
    """The warm pods of one pool (all pools when `pool_key` is empty)."""
    sel = f"{contract.LABEL_POOL}={contract.POOL_WARM}"
    return f"{sel},{contract.LABEL_POOL_KEY}={pool_key}" if pool_key else sel


def bound_selector(md_name: str) -> str:
    """The identity-keyed warm pods made for one deployment (every shape's)."""
    return f"{contract.LABEL_POOL}={contract.POOL_WARM},{contract.LABEL_WARM_FOR}={md_name}"


def selector(md_name: str, pool: str = contract.POOL_SERVING) -> str:
    """status.selector: the serving pods of one deployment (what the HPA counts); with `pool`
    draining, its pods out of service."""
    return f"{contract.LABEL_DEPLOYMENT}={md_name},{contract.LABEL_POOL}={pool}"
