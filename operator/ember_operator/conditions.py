"""Conditions (the truth of a status) and the events their transitions produce.

A condition keeps its lastTransitionTime while its status does not change; every status or reason
change becomes one Kubernetes event (Normal, or Warning for the reasons in `WARNING_REASONS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from ember_operator.api import Condition, ConditionStatus

WARNING_REASONS = frozenset({
    "SaveFailed", "CredentialsSecretMissing", "StoreUnreachable", "ManifestMissing", "NativeCapture",
    "PartialFallback", "ReplicasNotReady", "InvalidSpec", "ManifestInvalid", "ManifestDeleted",
    "ManifestReplaced", "SaveUnschedulable", "SaveFailedCreate", "CreateRejected",
    "StoreNotConfigured", "LocalStoreOutsideRoot", "StoreEndpointNotAllowed", "OperatorCredentialsNotAllowed",
})


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def rfc3339(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def get(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def put(
    conditions: list[Condition], type_: str, status: bool | None, reason: str, message: str,
    generation: int | None, now: datetime,
) -> list[Condition]:
    """A copy of `conditions` with `type_` set; lastTransitionTime moves only on a status change."""
    new_status = {
        True: ConditionStatus.true, False: ConditionStatus.false, None: ConditionStatus.unknown,
    }[status]
    old = get(conditions, type_)
    since = old.last_transition_time if old is not None and old.status is new_status else rfc3339(now)
    cond = Condition(
        type=type_, status=new_status, reason=reason, message=message[:32768],
        observed_generation=generation, last_transition_time=since,
    )
    return [c for c in conditions if c.type != type_] + [cond]


def transitions(old: list[Condition], new: list[Condition]) -> list[Event]:
    """One event per condition (but `Ready`) whose status or reason changed."""
    events = []
    for cond in new:
        if cond.type == "Ready":
            continue  # the phase summarizes it, and a change of phase has its own event
        before = get(old, cond.type)
        if before is not None and before.status == cond.status and before.reason == cond.reason:
            continue
        kind = "Warning" if (cond.reason in WARNING_REASONS and cond.status is not ConditionStatus.true) \
            or cond.reason in ("NativeCapture", "PartialFallback") else "Normal"
        text = f"{cond.type}={cond.status.value} ({cond.reason})"
        if cond.message:
            text += f": {cond.message}"
        events.append(Event(kind, cond.reason or cond.type, text))
    return events
