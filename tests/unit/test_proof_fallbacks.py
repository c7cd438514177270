"""SAVE's proof again with less when it fails (ember.runtime.proof.fallbacks): union templates
are dropped before the cut kernel images, and only what failed is given up."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ember.runtime.proof.fallbacks import prove_falling_back


@dataclass
class Report:
    ok: bool
    unions: int
    mismatches: list[str] = field(default_factory=list)
    unions_dropped: str = ""
    graphs: int = 3
    dedicated_ok: int = 3


class Lib:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Prover:
    """Fails while the unions (when `unions_bad`) or the cut images (when `cut_bad`) are in."""

    def __init__(self, unions_bad: bool, cut_bad: bool) -> None:
        self.unions_bad, self.cut_bad, self.cut = unions_bad, cut_bad, True
        self.calls: list[tuple[bool | None, bool]] = []
        self.libs: list[Lib] = []

    def __call__(self, unions: bool | None) -> tuple[Report, bytes, Lib]:
        self.calls.append((unions, self.cut))
        with_unions = unions is not False
        bad = (self.unions_bad and with_unions) or (self.cut_bad and self.cut)
        lib = Lib()
        self.libs.append(lib)
        return Report(not bad, 2 if with_unions else 0, ["graph (280,): differs"] if bad else []), b"", lib

    def undo(self) -> None:
        self.cut = False


@pytest.mark.parametrize(
    ("unions_bad", "cut_bad", "calls", "still_cut", "dropped"),
    [
        (False, False, [(None, True)], True, False),
        (True, False, [(None, True), (False, True)], True, True),  # the images stay cut
        (False, True, [(None, True), (False, True), (None, False)], False, False),  # unions kept
        (True, True, [(None, True), (False, True), (None, False), (False, False)], False, True),
    ],
    ids=["passes", "unions fail", "cut images fail", "both fail"],
)
def test_unions_are_dropped_before_the_cut_images(
    unions_bad: bool, cut_bad: bool, calls: list[tuple[bool | None, bool]], still_cut: bool, dropped: bool
) -> None:
    p, lines = Prover(unions_bad, cut_bad), []
    rep, _, lib, cut = prove_falling_back(p, True, p.undo, lines.append)
    assert p.calls == calls and cut is still_cut
    assert rep.ok and bool(rep.unions_dropped) is dropped and len(lines) == len(calls) - 1
    assert bool(rep.unions) is not dropped
    assert all(old.closed for old in p.libs[:-1]) and lib is p.libs[-1] and not lib.closed


def test_a_proof_without_unions_or_cut_images_has_nothing_to_drop() -> None:
    p = Prover(unions_bad=False, cut_bad=True)
    p.cut = True
    rep, _, _, cut = prove_falling_back(lambda u: (Report(False, 0, ["differs"]), b"", Lib()), False, p.undo,
                                        print)
    assert not rep.ok and not cut and p.cut  # nothing undone, the failure is SAVE's to report


def test_unions_are_kept_when_a_graphs_own_exec_is_wrong_too() -> None:
    """Dropping unions cannot mend a dedicated exec: the proof is not run again for them (each run
    of a deep model's proof can take minutes), only for the cut images."""
    p = Prover(unions_bad=False, cut_bad=True)
    calls: list[bool | None] = []

    def prove(unions: bool | None) -> tuple[Report, bytes, Lib]:
        calls.append(unions)
        return Report(False, 2, ["graph (1,): dedicated exec differs"], dedicated_ok=2), b"", Lib()

    rep, _, _, cut = prove_falling_back(prove, True, p.undo, print)
    assert calls == [None, None] and not cut and not p.cut  # once cut, once whole; unions never dropped
    assert not rep.ok and not rep.unions_dropped
