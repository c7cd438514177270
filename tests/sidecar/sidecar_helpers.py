"""Shared test helpers for the sidecar tiers: a recording Reporter and metric readers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ember_sidecar.metrics import Metrics


class RecordingReporter:
    """A real Reporter that keeps what it was told (the standalone LogReporter, plus events)."""

    def __init__(self) -> None:
        self.results: list[str] = []
        self.events: list[tuple[str, str, str, bool]] = []

    def result(self, value: str) -> None:
        self.results.append(value)

    def event(self, type_: str, reason: str, message: str, *, deployment: bool = False) -> None:
        self.events.append((type_, reason, message, deployment))


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
