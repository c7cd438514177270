"""Parsing the operator's pod annotations into a Claim (pure; no Kubernetes client here).

Annotations (all under ember.dev/): `archive` = store URI of the manifest, `identity` = identity
hash, optional `rank`/`world` (multi-GPU), optional `claimed-at` (epoch seconds or RFC 3339 with
fractional seconds, set by the operator in the claim patch, so claim→fetch is measured from the
operator's clock),
and `prefetch` on warm pods (manifest URIs, comma/whitespace separated or a JSON list).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass
from typing import Any

from ember.store import StoreError, split_manifest_uri

PREFIX = "ember.dev/"
ARCHIVE = PREFIX + "archive"
IDENTITY = PREFIX + "identity"
RANK = PREFIX + "rank"
WORLD = PREFIX + "world"
CLAIMED_AT = PREFIX + "claimed-at"
PREFETCH = PREFIX + "prefetch"
NATIVE_REASON = PREFIX + "native-reason"  # set by the operator when it claims without an archive
RESTORE = PREFIX + "restore"
RESTORE_TIME = PREFIX + "restore-time"
DEPLOYMENT_LABEL = PREFIX + "deployment"
POOL_LABEL = PREFIX + "pool"

_IDENTITY_RE = re.compile(r"^[0-9a-f]{8,64}$")


class ClaimError(ValueError):
    """The claim annotations are present but malformed (a fallback reason, not a crash)."""


@dataclass(frozen=True)
class Claim:
    """What the operator asked this pod to restore."""

    archive_uri: str
    identity: str
    rank: int = 0
    world: int = 1
    claimed_at: float | None = None

    @property
    def key(self) -> tuple[str, str, int, int]:
        """Two claims with the same key are the same restore (watch events repeat)."""
        return (self.archive_uri, self.identity, self.rank, self.world)


def manifest_identity(uri: str) -> str | None:
    """The identity hash inside a manifest URI (…/archives/<hash>/manifest), or None."""
    try:
        return split_manifest_uri(uri)[1]
    except StoreError:
        return None


def _int(annotations: dict[str, str], key: str, default: int) -> int:
    raw = annotations.get(key)
    if raw in (None, ""):
        return default
    try:
        return int(str(raw).strip())
    except ValueError:
        raise ClaimError(f"annotation {key}={raw!r} is not an integer") from None


def parse_claim(annotations: dict[str, str] | None) -> Claim | None:
    """The claim in a pod's annotations; None when the pod is not claimed (warm).

    Raises ClaimError when the claim is present but unusable: then the pod must fall back.
    """
    annotations = annotations or {}
    archive = (annotations.get(ARCHIVE) or "").strip()
    identity = (annotations.get(IDENTITY) or "").strip()
    if not archive and not identity:
        return None
    if not archive:
        if reason := (annotations.get(NATIVE_REASON) or "").strip():
            raise ClaimError(f"native capture chosen by the operator: {reason}")
        raise ClaimError(f"claim has {IDENTITY} but no {ARCHIVE}")
    if not identity:
        raise ClaimError(f"claim has {ARCHIVE} but no {IDENTITY}")
    if not _IDENTITY_RE.match(identity):
        raise ClaimError(f"{IDENTITY}={identity!r} is not an identity hash (lowercase hex)")
    in_uri = manifest_identity(archive)
    if in_uri is None:
        raise ClaimError(f"{ARCHIVE}={archive!r} is not a manifest URI (…/archives/<hash>/manifest)")
    if in_uri != identity:
        raise ClaimError(f"identity-mismatch: {ARCHIVE} names {in_uri[:16]}…, {IDENTITY} is {identity[:16]}…")
    rank, world = _int(annotations, RANK, 0), _int(annotations, WORLD, 1)
    if world < 1 or not 0 <= rank < world:
        raise ClaimError(f"rank {rank} / world {world} is not a valid rank layout")
    return Claim(archive, identity, rank, world, parse_claimed_at(annotations.get(CLAIMED_AT)))


def parse_claimed_at(raw: str | None) -> float | None:
    """Epoch seconds of the operator's claim stamp: a float, or RFC 3339 WITH fractional seconds.

    A whole-second RFC 3339 stamp is too coarse to time a sub-second stage, so it is ignored
    (claim→fetch is then measured from the watch event). Informative only: never fails a claim.
    """
    raw = (raw or "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        pass
    if "." not in raw:
        return None
    try:
        stamp = dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.UTC)
    return stamp.timestamp()


def parse_prefetch(annotations: dict[str, str] | None) -> list[str]:
    """Manifest URIs a warm pod should cache before any claim (bad entries are dropped)."""
    raw = ((annotations or {}).get(PREFETCH) or "").strip()
    if not raw:
        return []
    items: list[Any]
    if raw.startswith("["):
        try:
            items = json.loads(raw)
        except ValueError:
            return []
        if not isinstance(items, list):
            return []
    else:
        items = re.split(r"[,\s]+", raw)
    out = [str(i).strip() for i in items if isinstance(i, str) and manifest_identity(i.strip())]
    return list(dict.fromkeys(out))


def reason_class(reason: str) -> str:
    """The metric label for a fallback reason: its prefix before ':' (bounded cardinality)."""
    head = reason.split(":", 1)[0].strip().lower()
    head = re.sub(r"[^a-z0-9-]+", "-", head).strip("-")
    return head[:48] or "unknown"
