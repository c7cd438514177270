"""An archive whose CB canary is of another kind than this engine checks (one SAVEd before the
canary looked at its request's rows) is refused with that reason, not compared and reported as a
fault; one of the same kind goes on to the comparison."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ember.engines.transformers_cb import adapter as cb_adapter
from ember.engines.transformers_cb.canary import KIND
from ember.runtime.adapter import Refused


class _Compared(Exception):
    """The canary went on to compare (the fake stops it there)."""


def _verify(saved: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.runtime import verify

    def compare(*args: Any, **kwargs: Any) -> None:
        raise _Compared

    monkeypatch.setattr(verify, "canary", compare)
    monkeypatch.setattr(verify, "round_trip", lambda library, index: None)
    a = cb_adapter.CBEngineAdapter()
    a._canary = saved
    a.verify(SimpleNamespace(order=[0], keys=[(0, 1)]))  # type: ignore[arg-type]


def test_an_archive_with_another_canary_kind_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    old = {"key": [0, 1], "fingerprint": [1, 2, 3]}  # before: no kind, word sums of the whole cache
    with pytest.raises(Refused, match="another kind"):
        _verify(old, monkeypatch)
    with pytest.raises(_Compared):
        _verify({**old, "kind": KIND}, monkeypatch)
