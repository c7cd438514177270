"""cb_runtime.open_early → restore_into: which opened archive the engine's start takes over.

`_open` (ArchiveRestore.open with the CB engine's checks) is replaced by a recorder: what is under
test is the hand-over, not the open itself (tests/native/test_restore.py covers that).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ember.engines.transformers_cb import adapter as cb_runtime
from ember.engines.transformers_cb.adapter import RestoreRefused


class _Restore:
    def __init__(self, archive_dir: Path) -> None:
        self.archive_dir = archive_dir
        self.abandoned = False
        self.manifest = SimpleNamespace(engine={})
        self.accepted = ("sizing", archive_dir.name)
        self.timings: dict[str, float] = {}

    def abandon(self) -> None:
        self.abandoned = True


class _Engine:
    """Starts restored without launching anything: returns what restore_into reports on."""

    def __init__(self) -> None:
        self.accepted: Any = None

    def start_restored(self, accepted: Any, load: Any) -> Any:
        self.accepted = accepted
        return SimpleNamespace(seconds={}, graphs=0)


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []

    def fake_open(archive_dir: Path, ip: Any) -> _Restore:
        if archive_dir.name == "foreign":
            calls.append(("refused", archive_dir))
            raise RestoreRefused("compat", "compatibility key differs")
        restore = _Restore(archive_dir)
        calls.append(restore)
        return restore

    monkeypatch.setattr(cb_runtime, "_open", fake_open)
    monkeypatch.setattr(cb_runtime, "_EARLY", None)
    return calls


def test_the_engine_start_takes_over_the_early_archive(opened: list[Any], tmp_path: Path) -> None:
    cb_runtime.open_early(tmp_path / "a")
    assert len(opened) == 1  # opened now, before any engine exists
    engine = _Engine()
    cb_runtime.restore_into(engine, tmp_path / "a")
    assert len(opened) == 1 and engine.accepted == ("sizing", "a")  # not opened a second time
    assert not opened[0].abandoned
    cb_runtime.restore_into(_Engine(), tmp_path / "a")  # taken once: a later start opens afresh
    assert len(opened) == 2


def test_an_early_refusal_is_the_engine_starts_refusal(opened: list[Any], tmp_path: Path) -> None:
    cb_runtime.open_early(tmp_path / "foreign")  # does not raise: the model still gets built
    with pytest.raises(RestoreRefused, match="compatibility key differs") as refused:
        cb_runtime.restore_into(_Engine(), tmp_path / "foreign")
    assert refused.value.stage == "compat"
    assert opened == [("refused", tmp_path / "foreign")]  # refused once, not opened again


def test_another_archive_handed_over_abandons_the_early_one(opened: list[Any], tmp_path: Path) -> None:
    cb_runtime.open_early(tmp_path / "a")
    engine = _Engine()
    cb_runtime.restore_into(engine, tmp_path / "b")
    early, used = opened
    assert early.abandoned and not used.abandoned
    assert engine.accepted == ("sizing", "b")
