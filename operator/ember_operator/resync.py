"""The resync loop's reads: which objects exist, and whether this replica leads.

kopf timers would do the periodic resync, but kopf puts a finalizer on every object with a timer;
the loop in `handlers` replaces them. kopf pauses its own handlers while a peer of higher priority
is alive (peering); the loop checks the same peering object so a standby replica stays idle.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from ember import contract
from ember_operator.kube import Kube, KubeError
from ember_operator.settings import Settings

log = logging.getLogger("ember_operator")
PEERING = "/apis/kopf.dev/v1"


def list_names(kube: Kube, settings: Settings, plural: str) -> list[tuple[str, str]]:
    """(namespace, name) of every object of `plural` in the watched namespaces."""
    base = f"/apis/{contract.API_VERSION}"
    paths = [f"{base}/namespaces/{ns}/{plural}" for ns in settings.namespace_list()] or [f"{base}/{plural}"]
    return [(o["metadata"]["namespace"], o["metadata"]["name"]) for p in paths for o in kube.list(p)]


def _alive(peer: dict[str, object], now: datetime) -> bool:
    try:
        seen = datetime.fromisoformat(str(peer.get("lastseen")))
        lifetime = float(peer.get("lifetime") or 60)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    if seen.tzinfo is None:
        seen = seen.replace(tzinfo=UTC)
    return (now - seen).total_seconds() < lifetime


def leading(kube: Kube, settings: Settings) -> bool:
    """False while kopf peering lists a live peer of higher priority (kopf's own pause rule)."""
    if settings.standalone:
        return True
    namespaces = settings.namespace_list()
    paths = ([f"{PEERING}/namespaces/{ns}/kopfpeerings/{settings.peering_name}" for ns in namespaces]
             or [f"{PEERING}/clusterkopfpeerings/{settings.peering_name}"])
    now = datetime.now(UTC)
    for path in paths:
        try:
            peering = kube.get(path)
        except KubeError as exc:  # no peering CRDs or no RBAC: kopf runs unpaused too
            log.debug("Reading peering %s failed: %s", path, exc)
            continue
        peers = (peering or {}).get("status") or {}
        if any(isinstance(p, dict) and int(p.get("priority") or 0) > settings.priority and _alive(p, now)
               for p in peers.values()):
            return False
    return True
