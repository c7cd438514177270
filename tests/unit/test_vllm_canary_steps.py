"""CPU (torch): the vLLM canary's resets (`canary_run.Steps.reset`), with stand-in graph outputs.

Every path of a case starts from a reset that poisons the step's graph outputs. They are tensors
over SAVE's addresses, rebuilt from the archive's specs: 1–2 ms for a full-depth step's ~70
(h200-20261201c), so a case's are rebuilt once, not at each reset. What is poisoned must not
change: every output, except one a graph of the step also reads."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ember.engines.vllm import canary_run  # noqa: E402  (after the torch check)
from ember.engines.vllm.canary import Case  # noqa: E402


def test_a_case_rebuilds_its_outputs_once_and_poisons_them_at_every_reset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    memory = {name: torch.zeros(8, dtype=torch.bfloat16) for name in ("1,0,2", "1,1,2", "1,2,2")}
    rebuilt: list[str] = []

    def rebuild(spec: Any) -> Any:
        rebuilt.append(spec["name"])
        return (memory[spec["name"]],)

    monkeypatch.setattr(canary_run.sites, "rebuild", rebuild)
    keys = ((1, 0, 2), (1, 1, 2), (1, 2, 2))
    facts = {"outputs": {",".join(map(str, k)): {"name": ",".join(map(str, k))} for k in keys},
             # piece 2 reads piece 1's output (an in-place update): poisoning it would change the step
             "input_addresses": {"1,2,2": [memory["1,1,2"].data_ptr()]}}
    steps = canary_run.Steps(runner=None, kind="v2", facts=facts)
    case = Case("piecewise", 2, False, keys)

    for _ in range(5):
        for t in memory.values():
            t.fill_(1.0)  # what a path's step left there
        steps.reset(case)
        poisoned = {n: bool((t.view(torch.uint8) == canary_run.POISON).all()) for n, t in memory.items()}
        assert poisoned == {"1,0,2": True, "1,1,2": False, "1,2,2": True}
    assert rebuilt == ["1,0,2", "1,1,2", "1,2,2"]  # once, not once a reset

    other = Case("full", 2, True, keys[:1])
    steps.reset(other)
    assert rebuilt[3:] == ["1,0,2"]  # another case rebuilds its own


def test_outputs_of_every_size_and_dtype_are_poisoned_whole_and_a_strided_one_filled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each output's own bytes are poisoned, whatever its size and element type, and none past
    it; a strided output cannot be viewed as bytes, so it is filled (-3) instead."""
    base, pool = torch.zeros(4, 6), torch.ones(10, dtype=torch.bfloat16)
    memory = {"1,0,2": pool[:3], "1,1,2": torch.zeros(2, 5, dtype=torch.float32),
              "1,2,2": torch.zeros(7, dtype=torch.int64), "1,3,2": base.t()}
    monkeypatch.setattr(canary_run.sites, "rebuild", lambda spec: (memory[spec["name"]],))
    keys = tuple((1, i, 2) for i in range(4))
    facts = {"outputs": {",".join(map(str, k)): {"name": ",".join(map(str, k))} for k in keys}}
    steps = canary_run.Steps(runner=None, kind="v2", facts=facts)
    steps.reset(Case("piecewise", 2, False, keys))
    for name in ("1,0,2", "1,1,2", "1,2,2"):
        assert bool((memory[name].view(torch.uint8) == canary_run.POISON).all()), name
    assert bool((base == -3).all())
    assert bool((pool[3:] == 1).all())  # the memory past an output stays as it was
    # each piece's returned outputs compared where a reset sets them whole: not the strided one
    assert steps.compared(Case("piecewise", 2, False, keys)) == [[0], [0], [0], []]


def test_a_reset_poisons_the_cases_scratch_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scratch (what a step's graphs write inside, SAVE's ranges) is poisoned at every reset:
    a kernel that leaves part of it unwritten then leaves poison, not what an identical step left
    there. SAVE's plain runs (`scratch=False`) leave it alone. Its views are made once per case."""
    memory = torch.ones(64, dtype=torch.uint8)
    made: list[tuple[int, int]] = []

    def bytes_at(address: int, nbytes: int) -> Any:
        made.append((address, nbytes))
        return memory[address : address + nbytes]

    monkeypatch.setattr(canary_run, "_bytes_at", bytes_at)
    monkeypatch.setattr(canary_run.sites, "rebuild", lambda spec: None)
    keys = ((1, 0, 2),)
    facts = {"outputs": {"1,0,2": None}}
    steps = canary_run.Steps(runner=None, kind="v2", facts=facts, scratch={"piecewise": [[8, 8], [32, 4]]})
    case = Case("piecewise", 2, False, keys)

    steps.reset(case, scratch=False)
    assert bool((memory == 1).all())
    for _ in range(3):
        memory.fill_(1)
        steps.reset(case)
        poisoned = (memory == canary_run.POISON).nonzero().flatten().tolist()
        assert poisoned == [*range(8, 16), *range(32, 36)]
    assert made == [(8, 8), (32, 4)]
    assert steps.scratch(Case("full", 2, True, keys)) == []  # a case without scratch
