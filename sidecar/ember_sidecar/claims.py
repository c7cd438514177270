"""The sidecar's reading of the operator's claim: is it restorable, what to prefetch (pure).

The annotations themselves (keys, formats, `Claim`) are the pod contract's (`ember.contract`);
here the sidecar decides what it can restore: a manifest URI (…/archives/<hash>/manifest) whose
hash is the claimed identity, pinned to a manifest digest (`ember.dev/manifest-digest`, which the
operator writes on every claim that names an archive), in a valid rank layout. Anything else is a
`ClaimError`, which the restore logic turns into a fallback to native capture.
"""

from __future__ import annotations

import re

from ember import contract
from ember.contract import Claim, ClaimError, reason_class
from ember.identity import identity_short
from ember.store import StoreError, split_manifest_uri

__all__ = ["Claim", "ClaimError", "manifest_identity", "parse_claim", "parse_prefetch", "reason_class"]

_IDENTITY_RE = re.compile(r"^[0-9a-f]{8,64}$")
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


def manifest_identity(uri: str) -> str | None:
    """The identity hash inside a manifest URI (…/archives/<hash>/manifest), or None."""
    try:
        return split_manifest_uri(uri)[1]
    except StoreError:
        return None


def parse_claim(annotations: dict[str, str] | None) -> Claim | None:
    """The claim to restore from a pod's annotations; None when the pod is not claimed (warm).

    Raises ClaimError when the claim is present but not restorable (native capture chosen by the
    operator, or malformed): then the pod must fall back.
    """
    claim = Claim.from_annotations(annotations)
    if claim is None:
        return None
    archive, identity = claim.archive_uri, claim.identity
    ann_archive, ann_identity = contract.ANN_ARCHIVE, contract.ANN_IDENTITY
    if claim.native:
        if claim.native_reason:
            raise ClaimError(f"native capture chosen by the operator: {claim.native_reason}")
        raise ClaimError(f"claim has {ann_identity} but no {ann_archive}")
    if not identity:
        raise ClaimError(f"claim has {ann_archive} but no {ann_identity}")
    if not _IDENTITY_RE.match(identity):
        raise ClaimError(f"{ann_identity}={identity!r} is not an identity hash (lowercase hex)")
    in_uri = manifest_identity(archive)
    if in_uri is None:
        raise ClaimError(f"{ann_archive}={archive!r} is not a manifest URI (…/archives/<hash>/manifest)")
    if in_uri != identity:
        raise ClaimError(f"identity-mismatch: {ann_archive} names {identity_short(in_uri)}…, "
                         f"{ann_identity} is {identity_short(identity)}…")
    ann_digest = contract.ANN_MANIFEST_DIGEST
    if not claim.manifest_digest:
        raise ClaimError(f"claim has {ann_archive} but no {ann_digest}: the manifest is not pinned "
                         "(an operator older than this sidecar?)")
    if not _DIGEST_RE.match(claim.manifest_digest):
        raise ClaimError(f"{ann_digest}={claim.manifest_digest!r} is not a sha256 (64 lowercase hex)")
    if claim.world < 1 or not 0 <= claim.rank < claim.world:
        raise ClaimError(f"rank {claim.rank} / world {claim.world} is not a valid rank layout")
    return claim


def parse_prefetch(annotations: dict[str, str] | None) -> list[str]:
    """Manifest URIs a warm pod should cache before any claim (other entries are dropped)."""
    uris = contract.parse_prefetch((annotations or {}).get(contract.ANN_PREFETCH))
    return list(dict.fromkeys(u for u in uris if manifest_identity(u)))
