"""LOAD's canary (ember.runtime.verify): its verdicts, and the refusal the fallback path reports."""

from __future__ import annotations

from typing import Any

import pytest

from ember.runtime.adapter import Refused
from ember.runtime.verify import VERIFY, refuse_unless
from ember_sidecar.claims import reason_class


def test_a_failed_canary_refuses_with_its_own_reason_class() -> None:
    with pytest.raises(Refused) as err:
        refuse_unless({"ok": False, "why": "as instantiated: output 0: element 3 of 8 differs"}, 1, 0)
    assert err.value.stage == VERIFY
    assert "element 3 of 8" in err.value.reason
    assert reason_class(err.value.reason) == "canary-differs"  # the fallback metric's label


def test_a_passed_canary_lets_the_rank_serve() -> None:
    refuse_unless({"ok": True, "why": ""}, 1, 0)


class _Engine:
    """A step that writes [1, 2, 3]; the 'graph' can be wrong as instantiated or after an update."""

    def __init__(self, torch: Any, wrong_at: str = "") -> None:
        self.torch, self.wrong_at, self.updated, self.resets = torch, wrong_at, False, 0

    def own(self) -> list[Any]:
        return [self.torch.tensor([1, 2, 3])]

    def graph(self) -> list[Any]:
        bad = self.wrong_at == ("update" if self.updated else "instantiated")
        return [self.torch.tensor([1, 2, 4 if bad else 3])]

    def round_trip(self) -> bool:
        self.updated = True
        return True

    def reset(self) -> None:
        self.resets += 1


@pytest.mark.parametrize("wrong_at,why", [("", ""), ("instantiated", "as instantiated: output 0: element 2"),
                                          ("update", "after an exec update: output 0: element 2")])
def test_the_canary_compares_both_paths_bitwise(wrong_at: str, why: str) -> None:
    torch = pytest.importorskip("torch")
    from ember.runtime import verify

    e = _Engine(torch, wrong_at)
    r = verify.canary(e.own, e.graph, e.reset, e.round_trip)
    assert r["ok"] is (not why) and r["why"].startswith(why)
    assert e.resets >= 3  # every step from the same state
    if not wrong_at:
        assert r["checked"] == ["template", "exec update"]
        assert set(r["parts_ms"]) == {"reference", "template", "exec update", "reset"}  # where the time went


def test_the_own_exec_is_checked_too_and_a_lone_template_skips_the_update() -> None:
    torch = pytest.importorskip("torch")
    from ember.runtime import verify

    e = _Engine(torch)
    r = verify.canary(e.own, e.graph, e.reset, lambda: False, lambda: [torch.tensor([1, 2, 5])])
    assert r["checked"] == ["template", "own exec"]
    assert r["why"].startswith("on its own exec: output 0: element 2")


def test_on_n_ranks_every_path_runs_after_a_difference_and_the_first_one_is_kept() -> None:
    """Steps that issue collectives: a rank that stopped at its first difference would leave its
    peers waiting in the next path's collectives."""
    torch = pytest.importorskip("torch")
    from ember.runtime import verify

    e = _Engine(torch, "instantiated")
    ran: list[str] = []

    def own_exec() -> list[Any]:
        ran.append("own exec")
        return [torch.tensor([1, 2, 9])]

    r = verify.canary(e.own, e.graph, e.reset, e.round_trip, own_exec, every_path=True)
    assert r["checked"] == ["template", "exec update", "own exec"] and ran == ["own exec"]
    assert not r["ok"] and r["why"].startswith("as instantiated: output 0: element 2")
    f = _Engine(torch, "instantiated")
    assert verify.canary(f.own, f.graph, f.reset, f.round_trip, own_exec)["checked"] == ["template"]


def test_a_difference_names_its_first_element_how_many_differ_and_both_values_bits() -> None:
    """What SAVE's proof and the canary say of a difference: a lone subnormal (bf16 2**-128, the
    EP-over-TP proof's one deviating element) reads differently from garbage or a poisoned row."""
    torch = pytest.importorskip("torch")
    from ember.runtime import verify

    ref = torch.zeros(2, 3, dtype=torch.bfloat16)
    got = ref.clone()
    got[1, 1] = 2.0**-128
    assert verify.first_difference([ref], [got]) == (
        "output 0: element 4 of 6 differs (1 do): expected 0.0 (0x0000), got 2.938735877055719e-39 (0x0020)")
    poisoned = ref.clone()
    poisoned.view(-1).view(torch.uint8)[:6].fill_(0xA5)  # a skipped write leaves the proof's poison
    assert "(3 do)" in verify.first_difference([ref], [poisoned])
    assert "got 1 (0x00000001)" in verify.first_difference([torch.zeros(2, dtype=torch.int32)],
                                                           [torch.tensor([0, 1], dtype=torch.int32)])
    assert verify.first_difference([ref], [ref.clone()]) == ""


def test_a_recorded_reference_runs_no_step_and_needs_no_reset_and_the_last_reset_is_optional() -> None:
    """SAVE's fingerprint is the reference: one reset per path, and with `reset_after=False`
    (an engine whose canary steps leave nothing a request reads) none after the last."""
    torch = pytest.importorskip("torch")
    from ember.runtime import verify

    e = _Engine(torch)
    r = verify.canary([torch.tensor([1, 2, 3])], e.graph, e.reset, e.round_trip)
    assert r["ok"] and "reference" not in r["parts_ms"] and e.resets == 2 + 1
    f = _Engine(torch, "update")
    r = verify.canary([torch.tensor([1, 2, 3])], f.graph, f.reset, f.round_trip, reset_after=False)
    assert r["why"].startswith("after an exec update") and f.resets == 2
