"""`ember.runtime.profiled`: a diagnosis that writes where a block's time went, and never changes
the block's outcome."""

from __future__ import annotations

import cProfile
import logging
import os
import sys
from pathlib import Path

import pytest

from ember.runtime.profiled import profiled


def _work() -> int:
    return sum(i * i for i in range(20000))


def test_the_blocks_functions_are_written_by_cumulative_and_own_time(tmp_path: Path) -> None:
    with profiled(str(tmp_path / "prof"), "canary"):
        _work()
    text = (tmp_path / "prof" / f"canary-{os.getpid()}.txt").read_text()
    assert "_work" in text
    assert "cumulative" in text and "internal time" in text  # both orderings


def test_no_folder_no_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with profiled("", "canary"):
        _work()
    assert list(tmp_path.iterdir()) == []


def test_a_block_that_raises_still_raises_and_is_profiled(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError), profiled(str(tmp_path), "canary"):
        _work()
        _ = 1 / 0
    assert "_work" in (tmp_path / f"canary-{os.getpid()}.txt").read_text()


def test_a_folder_that_cannot_be_written_is_logged_not_raised(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="ember"), profiled(str(blocker / "sub"), "canary"):
        got = _work()
    assert got == sum(i * i for i in range(20000))
    assert "profile not written" in caplog.text


def test_a_profiler_already_active_leaves_the_block_unprofiled_not_failed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    outer = cProfile.Profile()
    try:
        outer.enable()
    except ValueError:
        pytest.skip("a profiler (coverage, a debugger) already holds this interpreter's hook")
    try:
        with caplog.at_level(logging.WARNING, logger="ember"), profiled(str(tmp_path), "canary"):
            got = _work()
    finally:
        outer.disable()
    assert got == sum(i * i for i in range(20000))
    if sys.version_info >= (3, 12):  # one profiler at a time since 3.12 (sys.monitoring)
        assert "not profiled" in caplog.text
        assert not list(tmp_path.iterdir())
