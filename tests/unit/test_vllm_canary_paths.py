"""CPU (torch): one vLLM canary case's paths (`canary_run.check_case`) over a stand-in library and
dummy step.

What is checked: the keys' own execs are built before the first step, and their build's time is
the canary's; a build that fails, or an own exec that computes otherwise, refuses, and a failed
build's path launches through the templates (what every other rank launches); with SAVE's
fingerprint as the reference no step runs for it, so it needs no reset, and nothing is reset
after the last path (a dummy step leaves nothing a request reads); the report says how long each
path spent in the graphs' launches."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ember.engines.vllm import canary_run  # noqa: E402  (after the torch check)
from ember.engines.vllm.canary import Case  # noqa: E402
from ember.runtime.proof.replay import fingerprint  # noqa: E402

# pieces 0 and 1 at 2 tokens (the case) and at 1 token (each piece's round trip goes there)
KEYS = [(1, 0, 2), (1, 1, 2), (1, 0, 1), (1, 1, 1)]
CASE = Case("piecewise", 2, False, tuple(KEYS[:2]))
BUILD_S = 0.2


class Own:
    """Own execs: each writes its key's value (`wrong`: one more); the build takes a while."""

    def __init__(self, lib: Lib, wrong: bool, fails: bool) -> None:
        self.lib, self.wrong, self.fails = lib, wrong, fails
        self.execs: dict[int, Any] = {}
        self.build_span: list[float] = []

    def has(self, i: int) -> bool:
        return i in self.execs

    def build(self, indices: list[int]) -> list[tuple[int, Any]]:
        start = time.perf_counter()
        time.sleep(BUILD_S)
        self.build_span[:] = [start, time.perf_counter()]
        if self.fails:
            raise RuntimeError("cuGraphInstantiate: out of memory")
        return [(i, lambda i=i: self.lib.write(i, i + 1 + int(self.wrong))) for i in indices]

    def adopt(self, i: int, ex: Any) -> None:
        self.execs[i] = ex

    def get(self, i: int) -> Any:
        return self.execs[i]


class Lib:
    """Key i's graph writes i + 1 into row i of the step's output; templates hold one key each.
    Piece 0 also writes 7 into `q` (`wrong_q`: 8), which piece 1 then reuses (writes 0): what piece
    0 hands to attention, which the step's end no longer shows."""

    def __init__(self, wrong_own: bool = False, build_fails: bool = False, wrong_q: bool = False) -> None:
        self.keys = list(KEYS)
        self.out = torch.zeros(2)
        self.q = torch.zeros(1)
        self.left = torch.zeros(1)  # returned by piece 1, not written by it, never reset
        self.wrong_q = wrong_q
        self.own = Own(self, wrong_own, build_fails)
        self.template_launches: list[float] = []

    def key_index(self, key: Any) -> int:
        return self.keys.index(tuple(key))

    def group_members(self, i: int) -> list[int]:
        return [j for j, k in enumerate(self.keys) if k[1] == self.keys[i][1]]

    def switch(self, i: int) -> None:
        pass

    def upload(self, execs: list[Any]) -> None:
        pass

    def write(self, i: int, value: int, eager: bool = False) -> None:
        piece = self.keys[i][1]
        self.out[piece] = value
        self.q.fill_(7 + int(self.wrong_q and not eager) if piece == 0 else 0)
        self.left += 1  # what earlier steps left: another value every step

    def outputs(self, key: Any) -> list[Any]:
        """A key's graph outputs (the per-piece fingerprints are over those every reset sets)."""
        row = self.out[key[1]:key[1] + 1]
        return [row, self.q] if key[1] == 0 else [row, self.left]

    def launch_template(self, i: int, stream: Any = None) -> None:
        self.template_launches.append(time.perf_counter())
        self.write(i, i + 1)


class Wrapper:
    """vLLM's CUDAGraphWrapper as the canary meets it: each piece of a step is called through it,
    which replays the piece's graph (graphs) or computes it (without), and returns its outputs."""

    runtime_mode = SimpleNamespace(name="PIECEWISE")

    def __init__(self, steps: Steps, key: Any, graphs: bool) -> None:
        self.steps, self.key, self.graphs = steps, key, graphs

    def __call__(self) -> list[Any]:
        lib = self.steps.lib
        if self.graphs:
            self.steps.routed[self.key].replay()
        else:
            lib.write(lib.key_index(self.key), lib.key_index(self.key) + 1, eager=True)
            if self.steps.eager_returns is not None:
                return lib.outputs(self.key)[:self.steps.eager_returns]
        return lib.outputs(self.key)


class Steps:
    """The dummy step: the case's pieces called in order through `Wrapper`."""

    def __init__(self, lib: Lib) -> None:
        self.lib, self.runner, self.resets = lib, object(), 0
        self.routed: dict[Any, Any] = {}
        self.skip: Any = None
        self.eager_returns: int | None = None  # an eager piece that returns fewer outputs
        self.rebuilt_ms = {CASE.name: 2.5}

    def reset(self, case: Case, scratch: bool = True) -> None:
        self.resets += 1
        self.lib.out.fill_(-1)
        self.lib.q.fill_(-1)

    def compared(self, case: Case) -> list[list[int]]:
        """Piece 0: its row and q; piece 1: its row (not `left`: no reset sets it)."""
        return [[0, 1] if key[1] == 0 else [0] for key in case.keys]

    def run(self, case: Case, graphs: bool) -> Any:
        for key in case.keys:
            if key != self.skip:  # a piece vLLM did not run
                Wrapper(self, key, graphs)()
        return self.lib.out.clone()


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Any:
    def make(**kw: Any) -> tuple[Lib, Steps]:
        lib = Lib(**kw)
        steps = Steps(lib)

        def replace(runner: Any, mine: dict[Any, Any]) -> dict[Any, Any]:
            before, steps.routed = steps.routed, mine
            return before

        monkeypatch.setattr(canary_run.sites, "replace", replace)
        monkeypatch.setattr(canary_run.sites, "wrapper_class", lambda: Wrapper)
        monkeypatch.setattr(canary_run, "launch_exec", lambda ex, stream=None: ex())
        return lib, steps

    return make


class Native:
    """A native graph as vLLM installed it (SAVE)."""

    def __init__(self, lib: Lib, index: int) -> None:
        self.lib, self.index = lib, index

    def replay(self) -> None:
        self.lib.write(self.index, self.index + 1)


# SAVE's: the step's end, then each graph's outputs as it launched (piece 0: its row and q = 7)
SAVED = (fingerprint([torch.tensor([1.0, 2.0])]) + fingerprint([torch.tensor([1.0]), torch.tensor([7.0])])
         + fingerprint([torch.tensor([2.0])]))


def test_own_execs_are_built_before_the_first_step_and_a_saved_reference_needs_no_reset(
        stand_in: Any) -> None:
    lib, steps = stand_in()
    result, problem = canary_run.check_case(steps, CASE, lib, SAVED, every_path=False)
    assert result["ok"] and not problem, (result, problem)
    assert result["checked"] == ["template", "exec update", "own exec"]
    assert result["pieces"] == 2  # each piece's outputs compared, not only the step's end
    assert lib.own.build_span[1] <= min(lib.template_launches)
    parts = result["parts_ms"]
    assert parts["own exec build"] >= BUILD_S * 1e3 and parts["outputs rebuilt"] == 2.5
    assert {"template graph calls", "exec update graph calls", "own exec graph calls"} <= set(parts)
    # against SAVE's fingerprint each path's own fingerprint is timed apart from its step
    assert {"template fingerprint", "exec update fingerprint", "own exec fingerprint"} <= set(parts)
    assert result["verify_ms"] >= BUILD_S * 1e3  # the build's time is the canary's
    assert steps.resets == 3  # one a path: none for SAVE's fingerprint, none after the last path


def test_an_own_exec_that_computes_otherwise_is_refused(stand_in: Any) -> None:
    lib, steps = stand_in(wrong_own=True)
    result, _ = canary_run.check_case(steps, CASE, lib, SAVED, every_path=False)
    assert not result["ok"] and result["why"].startswith("on its own exec")


def test_a_failed_build_refuses_and_its_path_launches_as_every_other_ranks(stand_in: Any) -> None:
    lib, steps = stand_in(build_fails=True)
    launches = len(lib.template_launches)
    result, problem = canary_run.check_case(steps, CASE, lib, None, every_path=True)
    assert "own execs could not be built" in problem and "out of memory" in problem
    assert result["checked"] == ["template", "exec update", "own exec"]
    assert len(lib.template_launches) - launches == 3 * len(CASE.keys)  # its own path went through them
    assert steps.resets == 4  # the eager reference is a step: it starts from a reset too


def test_a_piece_output_a_later_piece_overwrites_is_checked_where_the_piece_returned_it(
        stand_in: Any) -> None:
    """Piece 0's q is wrong and piece 1 reuses its memory: the step's end is right, the fingerprint
    taken as piece 0 returned is not, and the canary refuses, against SAVE's fingerprint (one GPU)
    and against an eager step (N ranks: the same positions of the eager pieces' outputs). What a
    piece returns but no reset sets (`left`, another value every step) is not compared: the clean
    restores pass both ways."""
    original = Wrapper.__call__
    lib, steps = stand_in(wrong_q=True)
    result, _ = canary_run.check_case(steps, CASE, lib, SAVED, every_path=False)
    assert not result["ok"] and result["why"].startswith("as instantiated: output 2"), result
    assert float(lib.q) == 0  # what the step's end shows of q: nothing wrong
    assert Wrapper.__call__ is original  # put back
    lib, steps = stand_in(wrong_q=True)
    result, _ = canary_run.check_case(steps, CASE, lib, None, every_path=False)
    assert not result["ok"] and result["why"].startswith("as instantiated: output 1"), result
    for saved in (SAVED, None):
        lib, steps = stand_in()
        result, _ = canary_run.check_case(steps, CASE, lib, saved, every_path=True)
        assert result["ok"] and result["pieces"] == 2, result


def test_an_eager_piece_that_returns_fewer_outputs_refuses_and_does_not_raise(stand_in: Any) -> None:
    """The eager step's pieces are compared by position with the restored ones'; where an eager
    piece returns fewer outputs (another structure) the prints differ in length: a refusal that
    says so, never a canary that raises or passes on what it could not compare."""
    lib, steps = stand_in()
    steps.eager_returns = 1
    result, _ = canary_run.check_case(steps, CASE, lib, None, every_path=True)
    assert not result["ok"] and "output 1: (3,) torch.int64, expected (2,)" in result["why"], result


def test_save_fingerprints_each_piece_and_records_no_step_that_skips_one(stand_in: Any) -> None:
    """SAVE's record of a step (`_stable`): the end, then each piece's outputs as it returned them;
    a step that did not run each of its pieces records why instead."""
    lib, steps = stand_in()
    steps.routed = {k: Native(lib, lib.key_index(k)) for k in CASE.keys}
    assert canary_run._stable(steps, CASE, scratch=False) == SAVED
    steps.skip = CASE.keys[1]
    assert canary_run._stable(steps, CASE, scratch=False) == "the native step ran 1 pieces, not its 2"
    full = Case("full", 2, True, CASE.keys[:1])  # a FULL step's pieces do not run apart: no prints
    steps.skip = None
    assert canary_run._stable(steps, full, scratch=False) == fingerprint([torch.tensor([1.0, -1.0])])
