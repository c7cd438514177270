"""The resync loop's read: which objects exist.

kopf timers would do the periodic resync, but kopf puts a finalizer on every object with a timer;
the loop in `handlers` replaces them (and runs only on the replica that leads: `leader`).
"""

from __future__ import annotations

from ember import contract
from ember_operator.kube import Kube
from ember_operator.settings import Settings


def list_names(kube: Kube, settings: Settings, plural: str) -> list[tuple[str, str]]:
    """(namespace, name) of every object of `plural` in the watched namespaces."""
    base = f"/apis/{contract.API_VERSION}"
    paths = [f"{base}/namespaces/{ns}/{plural}" for ns in settings.namespace_list()] or [f"{base}/{plural}"]
    return [(o["metadata"]["namespace"], o["metadata"]["name"]) for p in paths for o in kube.list(p)]
