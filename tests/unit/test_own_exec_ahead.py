"""The canary's own-exec build on a thread (`OwnExecs.get_ahead`) never outlives the library: a
canary that refuses on its first paths returns before launching it, and the library's close
(`OwnExecs.stop`, then every graph, event and splice destroyed) waits for the build to end."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from ember.runtime.graphs import own_execs


def test_stop_waits_for_a_build_the_canary_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(own_execs, "cu", SimpleNamespace(cuCtxSetCurrent=lambda ctx: (0,)))
    monkeypatch.setattr(own_execs, "check", lambda result, what: None)
    execs = own_execs.OwnExecs(SimpleNamespace(ctx="ctx"), hot_after=4)  # type: ignore[arg-type]
    building, release = threading.Event(), threading.Event()

    def get(index: int) -> Any:
        building.set()
        release.wait(10)
        return f"exec {index}"

    monkeypatch.setattr(execs, "get", get)
    built = execs.get_ahead(3)
    assert building.wait(5)
    stopping = threading.Thread(target=execs.stop)
    stopping.start()
    stopping.join(0.3)
    assert stopping.is_alive(), "stop returned while the canary's build still ran"
    release.set()
    stopping.join(5)
    assert not stopping.is_alive() and built.result(0) == "exec 3"


def test_stop_after_a_failed_build_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that raised is met by the canary where it launches, not by the close."""
    monkeypatch.setattr(own_execs, "cu", SimpleNamespace(cuCtxSetCurrent=lambda ctx: (0,)))
    monkeypatch.setattr(own_execs, "check", lambda result, what: None)
    execs = own_execs.OwnExecs(SimpleNamespace(ctx="ctx"), hot_after=4)  # type: ignore[arg-type]

    def get(index: int) -> Any:
        raise RuntimeError("instantiate failed")

    monkeypatch.setattr(execs, "get", get)
    built = execs.get_ahead(1)
    execs.stop()
    with pytest.raises(RuntimeError, match="instantiate failed"):
        built.result(0)
