"""A ModelDeployment's phase and its `Ready` condition, both derived from the other conditions.

`ArchiveReady`, `Available`, `Progressing` and `Schedulable` are the truth (set by `planning` and
`reconcilers`); `settle` derives the phase from them and writes `Ready`: True exactly when the
phase is `Ready` (every replica ready and restoring, nothing in progress), else False with the
phase as its reason and the deciding condition's message. `kubectl wait --for=condition=Ready`,
Argo CD and kstatus read it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ember_operator import conditions, tenancy
from ember_operator.api import Condition, MDPhase, ModelDeploymentStatus
from ember_operator.limits import GPUS_ABOVE_LIMIT

ARCHIVE_READY = "ArchiveReady"
AVAILABLE = "Available"
PROGRESSING = "Progressing"
SCHEDULABLE = "Schedulable"
READY = "Ready"
INVALID_SPEC = "InvalidSpec"
REFUSED_REASONS = frozenset({INVALID_SPEC, GPUS_ABOVE_LIMIT, *tenancy.REASONS})  # → phase Invalid
ORDER = [READY, ARCHIVE_READY, AVAILABLE, PROGRESSING, SCHEDULABLE]


def _false(c: Condition | None) -> bool:
    return c is not None and c.status.value == "False"


def derive_phase(conds: list[Any]) -> MDPhase:
    """The phase is a summary of the conditions (never stored state of its own)."""
    prog = conditions.get(conds, PROGRESSING)
    avail = conditions.get(conds, AVAILABLE)
    if prog is not None and prog.status.value == "False" and prog.reason in REFUSED_REASONS:
        return MDPhase.invalid
    if prog is not None and prog.status.value == "True":
        try:
            return MDPhase(prog.reason)
        except ValueError:
            return MDPhase.deploying
    if avail is not None and avail.reason in ("NativeCapture", "PartialFallback"):
        return MDPhase.degraded
    if avail is not None and avail.status.value != "True":
        return MDPhase.degraded
    # Never Ready while new pods could not restore (the archive is gone, invalid or unreachable)
    # or while pods of the deployment cannot be scheduled.
    archive = conditions.get(conds, ARCHIVE_READY)
    scaled_to_zero = avail is not None and avail.reason == "ScaledToZero"
    if archive is not None and archive.status.value != "True" and not scaled_to_zero:
        return MDPhase.degraded
    if _false(conditions.get(conds, SCHEDULABLE)):
        return MDPhase.degraded
    return MDPhase.ready


def _why(conds: list[Condition], phase: MDPhase) -> str:
    """The message of the condition that keeps the deployment from Ready."""
    prog, avail = conditions.get(conds, PROGRESSING), conditions.get(conds, AVAILABLE)
    if phase is MDPhase.invalid or (prog is not None and prog.status.value == "True"):
        return prog.message if prog is not None else ""
    for cond in (conditions.get(conds, ARCHIVE_READY), conditions.get(conds, SCHEDULABLE)):
        if _false(cond) and cond is not None:
            return cond.message
    if _false(prog) and prog is not None and prog.reason != "Complete":
        return prog.message  # e.g. CreateRejected
    return avail.message if avail is not None else ""


def settle(st: ModelDeploymentStatus, generation: int | None, now: datetime) -> None:
    """`st.phase` from the conditions, and the `Ready` condition from the phase."""
    phase = st.phase = derive_phase(st.conditions)
    others = [c for c in st.conditions if c.type != READY]
    if phase is MDPhase.ready:
        avail = conditions.get(others, AVAILABLE)
        ready: tuple[bool, str, str] = (True, "Ready", avail.message if avail is not None else "")
    else:
        ready = (False, phase.value, _why(others, phase))
    conds = conditions.put(st.conditions, READY, *ready, generation, now)
    st.conditions = sorted(conds, key=lambda c: ORDER.index(c.type) if c.type in ORDER else 9)
