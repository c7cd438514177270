"""An archive whose CB canary is of another kind than this engine checks (one SAVEd before the
canary looked at its request's rows) is refused with that reason, not compared and reported as a
fault; one of the same kind goes on to the comparison."""

from __future__ import annotations

from concurrent.futures import Future
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
    a.verify(_library())  # type: ignore[arg-type]


def _library() -> SimpleNamespace:
    """A one-key library whose own exec for the canary is ready (a fake handle)."""
    built: Future[Any] = Future()
    built.set_result("exec")
    return SimpleNamespace(order=[0], keys=[(0, 1)], own=SimpleNamespace(get_ahead=lambda index: built))


def test_an_archive_with_another_canary_kind_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    old = {"key": [0, 1], "fingerprint": [1, 2, 3]}  # before: no kind, word sums of the whole cache
    with pytest.raises(Refused, match="another kind"):
        _verify(old, monkeypatch)
    with pytest.raises(_Compared):
        _verify({**old, "kind": KIND}, monkeypatch)


def test_each_path_of_the_canary_reports_where_its_time_went(monkeypatch: pytest.MonkeyPatch) -> None:
    """The template, exec-update and own-exec paths each get their batch, rows, graph and
    fingerprint times in the canary's parts, named by path (the exec update is graph_step's
    second call)."""
    from ember.runtime import verify

    calls: list[str] = []

    def canary(akey: Any, launch: Any, times: dict[str, float]) -> list[int]:
        calls.append("step")
        times.update(batch=10.0 * len(calls), rows=1.0, graph=5.0, fingerprint=2.0)
        return [7]

    def run(ref: Any, graph_step: Any, reset: Any, round_trip: Any, own_exec_step: Any) -> dict[str, Any]:
        assert graph_step() == ref and graph_step() == ref and own_exec_step() == ref
        return {"ok": True, "why": "", "checked": ["template", "exec update", "own exec"],
                "verify_ms": 50.0, "parts_ms": {"template": 20.0}}

    monkeypatch.setattr(verify, "canary", run)
    monkeypatch.setattr(verify, "round_trip", lambda library, index: None)
    a = cb_adapter.CBEngineAdapter()
    a._canary = {"key": [0, 1], "fingerprint": [7], "kind": KIND}
    a.cb = SimpleNamespace(hooks=SimpleNamespace(canary=canary))  # type: ignore[assignment]
    got = a.verify(_library())  # type: ignore[arg-type]
    parts = got["verify_parts"]
    assert parts["template"] == 20.0 and parts["template batch"] == 10.0
    assert parts["exec update batch"] == 20.0 and parts["own exec batch"] == 30.0
    assert {parts[f"{p} graph"] for p in ("template", "exec update", "own exec")} == {5.0}
    assert parts["own exec fingerprint"] == 2.0 and parts["template rows"] == 1.0


def test_the_cb_identity_names_the_canary_kind() -> None:
    """So an archive SAVEd with another kind is not looked up under this engine's identity."""
    from ember.engines.transformers_cb.keys import CBSizing

    sizing = CBSizing(block_size=256, num_blocks=64, max_batch_tokens=256, max_requests_per_batch=8,
                      q_padding_interval_size=256, kv_padding_interval_size=4096)
    ident = cb_adapter.cb_identity("m", sizing)
    assert ident.workload == {"canary": KIND}
    assert ident.model_copy(update={"workload": {"canary": "request-rows"}}).hash() != ident.hash()
