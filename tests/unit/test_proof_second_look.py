"""CPU (torch): the proof's per-graph verdict, `prove._prove_key`, with stand-in replays.

A captured graph whose native replays differ only now and then (a MoE piece's bf16 subnormals at
EP over TP, benchmarks/results/h200-20261201b) could agree in its first three replays while the
rebuilt one lands on the other value: refused, although native computes it too. Before refusing,
the proof replays native more (`SECOND_LOOK`), and judges the rebuilt graph against that spread.
A rebuilt graph that computes something native never does is still refused."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ember.runtime.proof import prove  # noqa: E402  (after the torch check)

TINY = 2.0 ** -128  # a float32 subnormal, as the MoE piece's bf16 ones


class _Own:
    def instantiate(self, i: int) -> None:
        pass

    def drop(self, i: int) -> None:
        pass


class _Lib:
    """One key; each path's replays write the next value of its own sequence to `out`."""

    def __init__(self, native: Iterator[float], template: Iterator[float], own: Iterator[float]) -> None:
        self.keys = [(1, 6, 8, -1, 0)]
        self.own = _Own()
        self.out = torch.zeros(4)
        self.paths = {"native": native, "template": template, "own": own}
        self.replays = {"native": 0, "template": 0, "own": 0}

    def _write(self, path: str) -> None:
        self.replays[path] += 1
        self.out.fill_(next(self.paths[path]))

    def replay(self) -> None:
        self._write("native")

    def launch_template(self, i: int) -> None:
        self._write("template")

    def launch(self, i: int) -> None:
        self._write("own")


def _verdict(lib: _Lib) -> tuple[Any, bool]:
    rep = prove.ProofReport(graphs=1)

    def run(launch: Callable[[], None]) -> list[Any]:
        lib.out.fill_(float("nan"))  # poisoned, as _Runner does
        launch()
        return [lib.out.clone()]

    stable = prove._prove_key(rep, lib, run, 0, lib.replay, dedicated=True, repeats=2,  # type: ignore[arg-type]
                              native_repeats=prove.NATIVE_REPEATS)
    return rep, stable


def _seq(*values: float, then: float = 0.0) -> Iterator[float]:
    yield from values
    while True:
        yield then


def test_a_rebuilt_graph_on_a_value_native_reaches_later_is_proven_within_its_spread() -> None:
    # native: three replays agree, the fifth gives the subnormal; the template lands on it
    lib = _Lib(_seq(0.0, 0.0, 0.0, 0.0, TINY), _seq(TINY, TINY), _seq(0.0))
    rep, stable = _verdict(lib)
    assert not stable and not rep.mismatches, rep.mismatches
    assert rep.within_spread == 1 and rep.bitwise == 0 and rep.template_ok == rep.dedicated_ok == 1
    (facts,) = rep.nondeterministic.values()
    assert facts["native_replays"] == prove.NATIVE_REPEATS + prove.SECOND_LOOK
    assert facts["native_spread"][0] == TINY and facts["rebuilt_deviation"][0] == 0.0


def test_a_rebuilt_graph_that_computes_what_native_never_does_is_refused_after_the_second_look() -> None:
    lib = _Lib(_seq(0.0), _seq(1.0, 1.0), _seq(0.0))
    rep, stable = _verdict(lib)
    assert stable and rep.template_ok == 0 and rep.bitwise == 0
    (why,) = rep.mismatches
    assert why.startswith("graph (1, 6, 8, -1, 0): template path output differs"), why
    assert "deviation per output [1.0]" in why
    assert lib.replays["native"] == prove.NATIVE_REPEATS + prove.SECOND_LOOK  # it looked again first


def test_a_rebuilt_graph_far_beyond_a_subnormal_spread_is_still_refused() -> None:
    lib = _Lib(_seq(0.0, 0.0, 0.0, 0.0, TINY), _seq(0.0, 0.0), _seq(1e-3))
    rep, _ = _verdict(lib)
    assert rep.dedicated_ok == 0 and rep.within_spread == 0
    (why,) = rep.mismatches
    assert why.startswith("graph (1, 6, 8, -1, 0): dedicated exec output differs"), why
    assert f"beyond the native spread [{TINY}]" in why


def test_a_graph_that_matches_takes_no_second_look() -> None:
    lib = _Lib(_seq(0.5, then=0.5), _seq(0.5, 0.5), _seq(0.5))
    rep, stable = _verdict(lib)
    assert stable and rep.bitwise == 1 and not rep.mismatches and not rep.nondeterministic
    assert lib.replays == {"native": prove.NATIVE_REPEATS, "template": 2, "own": 1}
