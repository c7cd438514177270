"""open_early → the engine's start (`restore_into` → `_take_early`): which opened archive it takes over.

`_open` (the pipeline's open_restore with the CB engine's checks) is replaced by a recorder: what is
under test is the hand-over, not the open itself (tests/native/test_restore.py covers that), nor
the engine start that follows (the GPU test tests/gpu/test_cb_restore.py runs it).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ember.engines.transformers_cb import adapter as cb_adapter
from ember.runtime.adapter import COMPAT, Refused


class _Restore:
    def __init__(self, archive_dir: Path) -> None:
        self.archive_dir = archive_dir
        self.abandoned = False
        self.manifest = SimpleNamespace(engine={})
        self.accepted = ("sizing", archive_dir.name)
        self.timings: dict[str, float] = {}

    def abandon(self) -> None:
        self.abandoned = True


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []

    def fake_open(archive_dir: Path, ip: Any) -> _Restore:
        if archive_dir.name == "foreign":
            calls.append(("refused", archive_dir))
            raise Refused(COMPAT, "compatibility key differs")
        restore = _Restore(archive_dir)
        calls.append(restore)
        return restore

    monkeypatch.setattr(cb_adapter, "_open", fake_open)
    monkeypatch.setattr(cb_adapter, "_EARLY", None)
    return calls


def test_the_engine_start_takes_over_the_early_archive(opened: list[Any], tmp_path: Path) -> None:
    cb_adapter.open_early(tmp_path / "a")
    assert len(opened) == 1  # opened now, before any engine exists
    taken = cb_adapter._take_early(tmp_path / "a", None)
    assert len(opened) == 1 and taken is opened[0]  # not opened a second time
    assert not opened[0].abandoned
    again = cb_adapter._take_early(tmp_path / "a", None)  # taken once: a later start opens afresh
    assert len(opened) == 2 and again is opened[1]


def test_an_early_refusal_is_the_engine_starts_refusal(opened: list[Any], tmp_path: Path) -> None:
    cb_adapter.open_early(tmp_path / "foreign")  # does not raise: the model still gets built
    with pytest.raises(Refused, match="compatibility key differs") as refused:
        cb_adapter._take_early(tmp_path / "foreign", None)
    assert refused.value.stage == "compat"
    assert opened == [("refused", tmp_path / "foreign")]  # refused once, not opened again


def test_another_archive_handed_over_abandons_the_early_one(opened: list[Any], tmp_path: Path) -> None:
    cb_adapter.open_early(tmp_path / "a")
    taken = cb_adapter._take_early(tmp_path / "b", None)
    early, used = opened
    assert early.abandoned and not used.abandoned
    assert taken is used and used.archive_dir == tmp_path / "b"
