"""The switch interval LOAD's background work runs under (ember/runtime/gil.py)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from ember.runtime import gil


@pytest.fixture(autouse=True)
def engine_interval() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(old)


def test_shortened_inside_and_restored_after() -> None:
    with gil.short_switch_interval():
        assert sys.getswitchinterval() == pytest.approx(200e-6)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_overlapping_users_on_other_threads_restore_only_when_the_last_ends() -> None:
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, float] = {}

    def second() -> None:
        first_in.wait()
        with gil.short_switch_interval():
            second_in.set()
            first_out.wait()
            seen["second, after the first left"] = sys.getswitchinterval()

    t = threading.Thread(target=second)
    t.start()
    with gil.short_switch_interval():
        first_in.set()
        second_in.wait()
    first_out.set()
    t.join()
    assert seen["second, after the first left"] == pytest.approx(200e-6)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_an_engines_shorter_interval_is_kept() -> None:
    sys.setswitchinterval(100e-6)
    with gil.short_switch_interval():
        assert sys.getswitchinterval() == pytest.approx(100e-6, rel=0.05)
    assert sys.getswitchinterval() == pytest.approx(100e-6, rel=0.05)


@pytest.mark.parametrize(("env", "inside"), [("0", 0.005), ("1000", 0.001), ("bogus", 200e-6), ("-5", 0.005)])
def test_configured_by_env(monkeypatch: pytest.MonkeyPatch, env: str, inside: float) -> None:
    monkeypatch.setenv("EMBER_SWITCH_INTERVAL_US", env)
    with gil.short_switch_interval():
        assert sys.getswitchinterval() == pytest.approx(inside)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_restored_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), gil.short_switch_interval():
        raise RuntimeError("refused")
    assert sys.getswitchinterval() == pytest.approx(0.005)
