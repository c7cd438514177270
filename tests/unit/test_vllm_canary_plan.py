"""LOAD's canary for vLLM without vLLM or a GPU: which steps it runs, against which reference,
what it poisons, how several steps make one verdict, the ranks' agreement, the refusal's way to
the report and the fallback reason, and what a refused LOAD leaves in the engine."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from ember.engines.vllm import canary, keys, report
from ember.engines.vllm.canary import EAGER, SAVED, UNCHECKED, Case
from ember.engines.vllm.keys import PIECEWISE_ENTRY, V1_FULL_ENTRY, V2_FULL_GRAPH, GraphConfig
from ember.runtime import faults
from ember.runtime.adapter import Refused
from ember.runtime.verify import VERIFY, refuse_unless
from ember_sidecar.claims import reason_class


def _keys(mode: str = "FULL_AND_PIECEWISE", runner: str = "v1", pieces: int = 3) -> list[tuple[int, ...]]:
    sizes = keys.default_capture_sizes(16, 2048)
    cfg = GraphConfig(mode, tuple(sizes), max(sizes), 16, runner=runner)
    return keys.enumerate_keys(cfg, pieces)


@pytest.mark.parametrize("runner,full_site", [("v1", V1_FULL_ENTRY), ("v2", V2_FULL_GRAPH)])
def test_the_canary_runs_the_second_smallest_piecewise_step_whole_and_decode_step(
        runner: str, full_site: int) -> None:
    pw, full = canary.cases(reversed(_keys(runner=runner)))  # any order in, launch order out
    assert pw.name == "piecewise" and pw.num_tokens == 2 and not pw.uniform
    assert pw.keys == tuple((PIECEWISE_ENTRY, p, 2, -1, 0) for p in range(3))  # every piece, in order
    assert full.name == "full" and full.full and full.uniform and full.num_tokens == 2
    assert full.keys == ((full_site, 0, 2, 2, 1),)
    # one capture size: the smallest is all there is
    (one,) = canary.cases([k for k in _keys("PIECEWISE", runner) if k[2] == 1])
    assert one.num_tokens == 1


def test_a_mode_without_full_or_piecewise_graphs_has_one_case() -> None:
    assert [c.name for c in canary.cases(_keys("PIECEWISE"))] == ["piecewise"]
    assert [c.name for c in canary.cases(_keys("FULL_DECODE_ONLY"))] == ["full"]
    (full,) = canary.cases(_keys("FULL"))  # FULL for every batch: no uniform descriptor
    assert full.keys[0][4] == 0 and full.num_tokens == 2
    assert canary.cases([]) == []


def test_every_full_size_is_a_step_of_its_own_when_asked() -> None:
    """EMBER_VLLM_CANARY_EVERY_FULL (diagnosis): which FULL graph differs, one step a size."""
    base = canary.cases(_keys())
    every = canary.cases(_keys(), every_full=True)
    assert every[: len(base)] == base  # the usual steps first, unchanged
    extra = every[len(base):]
    sizes = sorted({k[2] for k in _keys() if k[0] == V1_FULL_ENTRY and k[4]})
    assert [c.num_tokens for c in extra] == [n for n in sizes if n != 2]
    assert all(c.full and c.uniform and c.name == f"full@{c.num_tokens}" for c in extra)
    # on N ranks each is unchecked unless the eager reference is on, as the usual FULL step
    assert {canary.plan(c, 2, None, False) for c in extra} == {UNCHECKED}
    assert {canary.plan(c, 2, None, True) for c in extra} == {EAGER}


def test_the_round_trip_goes_through_the_next_smaller_member() -> None:
    key = (PIECEWISE_ENTRY, 0, 8, -1, 0)
    members = [(PIECEWISE_ENTRY, 0, n, -1, 0) for n in (16, 8, 1, 4)]
    assert canary.trip_member(key, members) == 3  # 4 tokens: the largest of fewer
    assert canary.trip_member(members[2], members) == 0  # nothing smaller: the first other
    assert canary.trip_member(key, [key]) is None


class _StaleLibrary:
    """Templates of one topology group whose exec update is stale (`faults.stale-update`: the
    template keeps the graph it held). A graph of n tokens computes rows [0, n) of the output."""

    def __init__(self, sizes: list[int], instantiated_from: int) -> None:
        self.keys = [(PIECEWISE_ENTRY, 0, n, -1, 0) for n in sizes]
        self.holds, self.runs = instantiated_from, instantiated_from  # label, graph really held

    def group_members(self, index: int) -> list[int]:
        return list(range(len(self.keys)))

    def switch(self, index: int) -> None:
        self.runs = self.holds  # stale: the graph of the key it held before, not `index`'s
        self.holds = index

    def step(self, index: int, rows: int) -> list[int]:
        if self.holds != index:
            self.switch(index)
        n = self.keys[self.runs][2]
        return [r * 10 if r < n else 0xA5 for r in range(rows)]  # rows a graph leaves: poisoned


def test_a_stale_update_shows_in_the_canarys_step_only_through_a_smaller_member() -> None:
    """Why the canary's step is not the smallest (the GPU showed it: a stale update on the V2
    runner's Llama passed a canary of the 1-token step)."""
    from ember.runtime.verify import round_trip

    sizes = [1, 2, 4, 8, 16]
    (case,) = canary.cases(_StaleLibrary(sizes, 0).keys)
    assert case.num_tokens == 2
    want = [r * 10 for r in range(case.num_tokens)]
    for held in range(len(sizes)):
        lib = _StaleLibrary(sizes, held)
        a = lib.keys.index(case.keys[0])
        lib.step(a, case.num_tokens)  # the template path
        other = canary.trip_member(lib.keys[a], lib.keys)
        assert round_trip(lib, a, other)()
        assert lib.step(a, case.num_tokens) != want  # after the exec update: refused
    # through a larger member (what a trip to the first other did), a 1-token step passes
    lib = _StaleLibrary(sizes, 4)
    lib.step(0, 1)
    assert round_trip(lib, 0, 3)() and lib.step(0, 1) == [0]


def _saved(cases: list[Case], prints: dict[str, Any]) -> dict[str, Any]:
    return canary.record(cases, prints)


def test_one_gpu_compares_with_saves_fingerprint_of_the_same_step_only() -> None:
    pw, full = canary.cases(_keys())
    saved = _saved([pw, full], {"piecewise": [1, 2], "full": "RuntimeError: no graph"})
    assert canary.plan(pw, 1, saved, False) == SAVED and canary.saved_fingerprint(saved, pw) == [1, 2]
    # SAVE could not run the FULL step: no fingerprint, and no eager reference unless asked
    assert canary.plan(full, 1, saved, False) == UNCHECKED
    assert canary.plan(full, 1, saved, True) == EAGER
    # another step (other pieces), another kind: not compared with a fingerprint
    other = Case("piecewise", 1, False, pw.keys[:2])
    assert canary.saved_fingerprint(saved, other) is None and canary.plan(other, 1, saved, False) == EAGER
    assert canary.saved_fingerprint({**saved, "kind": "request-rows"}, pw) is None
    assert canary.plan(pw, 1, None, False) == EAGER  # an archive saved before the canary


def test_n_ranks_never_use_a_fingerprint_save_made_without_data() -> None:
    pw, full = canary.cases(_keys())
    saved = _saved([pw, full], {"piecewise": [1, 2], "full": [3]})
    assert canary.plan(pw, 2, saved, False) == EAGER
    assert canary.plan(full, 2, saved, False) == UNCHECKED
    assert canary.plan(full, 2, saved, True) == EAGER


def test_n_ranks_check_the_full_step_eagerly_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember import settings

    pw, full = canary.cases(_keys())
    monkeypatch.delenv("EMBER_VLLM_CANARY_FULL_EAGER", raising=False)
    assert canary.plan(full, 2, None, settings.on("EMBER_VLLM_CANARY_FULL_EAGER")) == EAGER
    monkeypatch.setenv("EMBER_VLLM_CANARY_FULL_EAGER", "0")
    assert canary.plan(full, 2, None, settings.on("EMBER_VLLM_CANARY_FULL_EAGER")) == UNCHECKED
    assert canary.plan(pw, 2, None, settings.on("EMBER_VLLM_CANARY_FULL_EAGER")) == EAGER


def test_outputs_a_graph_of_the_step_reads_are_not_poisoned() -> None:
    outs = [(0x1000, 64), (0x2000, 64), (0x1000, 64), (0x3000, 0), (0x4000, 8)]
    assert canary.poison_targets(outs, [0x2000]) == [0, 4]  # read, duplicate, empty: left alone


def test_several_steps_make_one_verdict_with_their_costs() -> None:
    ok = {"ok": True, "why": "", "checked": ["template", "own exec"], "verify_ms": 4.0,
          "parts_ms": {"reference": 1.0, "template": 3.0}, "pieces": 3}
    bad = {**ok, "ok": False, "why": "as instantiated: output 0: element 3 of 8 differs", "verify_ms": 6.0,
           "pieces": 0}
    got = canary.combine({"piecewise": ok, "full": bad}, ["other"])
    assert got["pieces"] == {"piecewise": 3}  # how many pieces each step compared (none: not said)
    assert not got["ok"] and got["why"].startswith("full: as instantiated")
    assert got["verify_ms"] == 10.0 and got["parts_ms"]["full.template"] == 3.0
    assert got["checked"] == ["piecewise:template+own exec", "full:template+own exec", "other:unchecked"]
    assert canary.combine({"piecewise": ok})["ok"]
    assert not canary.failed("no runner")["ok"]


def test_a_rank_whose_canary_passed_refuses_with_its_failed_peers() -> None:
    heard: list[bool] = []

    def agree(ok: bool) -> bool:
        heard.append(ok)
        return False  # a peer's canary failed

    with pytest.raises(Refused) as err:
        refuse_unless({"ok": True, "why": ""}, 2, 0, agree)
    assert heard == [True] and err.value.stage == VERIFY
    assert "another rank's canary failed" in err.value.reason
    assert reason_class(err.value.reason) == "canary-differs"
    refuse_unless({"ok": True, "why": ""}, 2, 0, lambda ok: ok)


class _Cfg:
    def __init__(self, tp: int) -> None:
        self.parallel_config = SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=1,
                                               pipeline_parallel_size=1)


def _fake_run(monkeypatch: pytest.MonkeyPatch, run: Any) -> None:
    mod = types.ModuleType("ember.engines.vllm.canary_run")
    mod.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ember.engines.vllm.canary_run", mod)
    monkeypatch.setattr(sys.modules["ember.engines.vllm"], "canary_run", mod, raising=False)
    import ember.engines.vllm as pkg

    monkeypatch.setattr(pkg, "canary_run", mod, raising=False)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_canary_that_raises_refuses_and_still_takes_part_in_the_ranks_agreement(
        monkeypatch: pytest.MonkeyPatch, tp: int) -> None:
    from ember.engines.vllm import parallel
    from ember.engines.vllm.adapter import VllmAdapter

    def run(*_: Any) -> dict[str, Any]:
        raise RuntimeError("vLLM's dummy run changed")

    _fake_run(monkeypatch, run)
    votes: list[bool] = []
    monkeypatch.setattr(parallel, "agree", lambda ok: votes.append(ok) or ok)
    adapter = VllmAdapter(vllm_config=_Cfg(tp), runner_kind="v1")
    monkeypatch.setattr(adapter, "rank", lambda: tp - 1)
    with pytest.raises(Refused) as err:
        adapter.verify(SimpleNamespace(keys=[]))
    assert votes == ([False] if tp > 1 else [])  # one GPU: no peers to tell
    assert f"rank {tp - 1}: " in err.value.reason and "could not run: RuntimeError" in err.value.reason
    assert adapter.canary["ok"] is False


def test_a_passed_canary_reports_its_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.engines.vllm import parallel
    from ember.engines.vllm.adapter import VllmAdapter

    result = canary.combine({"piecewise": {"ok": True, "why": "", "checked": ["template"], "verify_ms": 7.5,
                                           "parts_ms": {"template": 5.0}}})
    _fake_run(monkeypatch, lambda *_: result)
    monkeypatch.setattr(parallel, "agree", lambda ok: ok)
    adapter = VllmAdapter(vllm_config=_Cfg(2), runner_kind="v2")
    monkeypatch.setattr(adapter, "rank", lambda: 1)
    got = adapter.verify(SimpleNamespace(keys=[]))
    assert got["verify_ms"] == 7.5 and got["verify_parts"] == {"piecewise.template": 5.0}


@pytest.mark.parametrize("tp", [1, 2])
def test_a_bench_without_the_canary_runs_none_and_its_report_says_so(
        monkeypatch: pytest.MonkeyPatch, tp: int) -> None:
    """`EMBER_VLLM_CANARY=0` (the bench's A/B of what the canary adds): no step runs, every rank
    still takes part in the agreement, and `checked` says the restore is unproven."""
    from ember.engines.vllm import parallel
    from ember.engines.vllm.adapter import VllmAdapter
    from ember.engines.vllm.plugin import verify_fields

    ran: list[bool] = []
    _fake_run(monkeypatch, lambda *_: ran.append(True) or canary.failed("ran"))
    votes: list[bool] = []
    monkeypatch.setattr(parallel, "agree", lambda ok: votes.append(ok) or ok)
    monkeypatch.setenv("EMBER_VLLM_CANARY", "0")
    adapter = VllmAdapter(vllm_config=_Cfg(tp), runner_kind="v1")
    monkeypatch.setattr(adapter, "rank", lambda: 0)
    got = adapter.verify(SimpleNamespace(keys=[]))
    assert ran == [] and votes == ([True] if tp > 1 else []) and got["verify_ms"] == 0.0
    assert verify_fields(adapter.canary)["checked"] == ["skipped: EMBER_VLLM_CANARY=0"]
    monkeypatch.setenv("EMBER_VLLM_CANARY", "1")  # the default: the canary runs, and refuses here
    with pytest.raises(Refused):
        adapter.verify(SimpleNamespace(keys=[]))
    assert ran == [True]


def test_a_refused_load_takes_the_restored_graphs_out_of_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.engines.vllm import graphs as sites
    from ember.engines.vllm.adapter import VllmAdapter

    wrapper = SimpleNamespace(concrete_cudagraph_entries={"bd": "restored"})
    monkeypatch.setattr(sites, "wrappers", lambda: {(PIECEWISE_ENTRY, 0): wrapper})
    manager = SimpleNamespace(graphs={"desc": "restored"}, hidden_states=None, _graphs_captured=False)
    runner = SimpleNamespace(cudagraph_manager=manager)
    adapter = VllmAdapter(runner, vllm_config=_Cfg(1), runner_kind="v2")
    adapter.uninstall()  # nothing installed: nothing touched
    assert wrapper.concrete_cudagraph_entries
    adapter._before, adapter._installed = sites.engine_state(runner), True
    manager.hidden_states, manager._graphs_captured = "SAVE's buffer", True  # what install did
    adapter.uninstall()
    assert wrapper.concrete_cudagraph_entries == {} and manager.graphs == {}
    assert manager.hidden_states is None and manager._graphs_captured is False  # vLLM captures anew


def test_the_skip_kernel_fault_leaves_out_a_kernel_with_plain_edges_only() -> None:
    kernels = np.array([0, 2, 3])
    src, dst = np.array([0, 2, 3]), np.array([2, 3, 4])
    plain = np.zeros(3, dtype=bool)
    assert faults.kernel_to_skip(kernels, src, dst, plain) == 3
    programmatic = np.array([False, True, False])  # 2 → 3 is programmatic
    assert faults.kernel_to_skip(kernels, src, dst, programmatic) == 0
    assert faults.kernel_to_skip(np.array([2, 3]), src, dst, programmatic) is None
    assert "skip-kernel" in faults.NAMES


def test_the_canarys_cost_and_verdict_reach_each_ranks_report(tmp_path: Path) -> None:
    path = tmp_path / "vllm-report.json"
    assert report.verify_cost(report.read(path)) == {}
    verify = {"ok": True, "verify_ms": 31.2, "parts_ms": {"piecewise.template": 9.0},
              "checked": ["piecewise:template"], "pieces": {"piecewise": 33}, "kv": ["full"]}
    report.write(path, {"stages": {"verify": verify}}, (1, 2))
    one = report.read(path)["ranks"]["1"]
    assert report.verify_cost(one) == {"ok": True, "verify_ms": 31.2, "parts_ms": {"piecewise.template": 9.0},
                                       "checked": ["piecewise:template"], "why": "",
                                       "pieces": {"piecewise": 33}, "kv": ["full"]}


def test_a_canary_refusal_on_n_ranks_keeps_its_reason_class_and_names_the_rank_that_saw_it(
        tmp_path: Path) -> None:
    from ember.serving.vllm import _not_restored

    path = tmp_path / "vllm-report.json"
    head = "canary differs: rank {}: restored graphs do not compute what the engine does: "
    report.write(path, {"stages": {"capture": {"how": "native-after-refusal"}, "load_refused": {
        "reason": head.format(0) + "another rank's canary failed"}}}, (0, 2))
    report.write(path, {"stages": {"capture": {"how": "native-after-refusal"}, "load_refused": {
        "reason": head.format(1) + "piecewise: as instantiated: output 0: element 5 of 64 differs"}}}, (1, 2))
    got = report.read(path)
    why = _not_restored(got, [one["stages"] for one in got["ranks"].values()])
    assert why.startswith("canary differs: rank 1: ") and why.endswith("(restored on 0 of 2 ranks)"), why
    assert reason_class(why) == "canary-differs"


def test_the_bench_reports_the_canarys_cost_per_run_and_per_rank(tmp_path: Path) -> None:
    from ember_bench.vllm_parallel import per_rank
    from ember_bench.vllm_report import markdown, summarize

    verify = {"ok": True, "verify_ms": 42.5, "parts_ms": {"piecewise.template": 9.0}, "checked": [],
              "pieces": {"piecewise": 32}, "kv": ["full"]}
    one = {"ember": {"stages": {"verify": verify, "capture": {"how": "restored"}}}}
    got = summarize({"native": {}, "load": one}, tmp_path)
    assert got["runs"]["load"]["verify_ms"] == 42.5 and got["runs"]["native"]["verify_ms"] is None
    assert got["runs"]["load"]["verify_parts_ms"] == {"piecewise.template": 9.0}
    assert "| verify_ms | — | 42.50 |" in markdown("m", 2, "gpu", got)
    ranks = per_rank({"ember": {"ranks": {"1": {"stages": {"verify": verify}}, "0": {"stages": {}}}}})
    assert ranks["1"]["verify_ms"] == 42.5 and ranks["1"]["verify_ok"] is True
    assert ranks["1"]["verify_pieces"] == {"piecewise": 32}  # how many pieces it compared
    assert ranks["1"]["verify_kv"] == ["full"]  # the steps over real KV slots
    assert ranks["0"]["verify_ms"] is None  # refused before its canary, or captured natively


def _segment(address: int, pool: tuple[int, int], blocks: list[tuple[int, int, str]]) -> dict[str, Any]:
    return {"address": address, "total_size": sum(b[1] for b in blocks), "segment_pool_id": pool,
            "blocks": [{"address": a, "size": n, "state": st} for a, n, st in blocks]}


def test_scratch_is_free_memory_of_the_graphs_pool_only() -> None:
    """Only blocks no tensor holds, of a private pool that holds a graph output: not the default
    pool's (eager tensors at LOAD), not another private pool's (a weights pool, vLLM's sleep mode)."""
    segments = [
        _segment(0x10000, (0, 0), [(0x10000, 0x100, "inactive"), (0x10100, 0x100, "active_allocated")]),
        _segment(0x20000, (0, 7), [(0x20000, 0x100, "active_allocated"), (0x20100, 0x300, "inactive")]),
        _segment(0x30000, (0, 7), [(0x30000, 0x80, "inactive"), (0x30080, 0, "inactive")]),
        _segment(0x40000, (3, 0), [(0x40000, 0x100, "inactive")]),
    ]
    pools = canary.graph_pools(segments, [0x20010, 0x10010])  # a graph output, an eager tensor
    assert pools == {(0, 7)}
    assert canary.pool_blocks(segments, pools) == [(0x20100, 0x300), (0x30000, 0x80)]
    assert canary.pool_blocks(segments, pools, "active_allocated") == [(0x20000, 0x100)]
    assert canary.block_states(segments, pools) == {"active_allocated": 0x100, "inactive": 0x380}
    assert canary.graph_pools(segments, [0x10010]) == set()  # an output in the default pool only
    assert canary.pool_blocks(segments, canary.graph_pools(segments, [])) == []


def test_scratch_is_the_free_blocks_the_steps_graphs_point_into_less_their_tensor_arguments() -> None:
    free = [(0x1000, 0x100), (0x2000, 0x100), (0x3000, 0x100)]
    words = [0x1010, 0x2fff, 0x3000, 0x30ff, 7, 0x2100]  # 0x2100: one past a block; 7: no pointer
    assert canary.scratch_ranges(words, free, []) == [(0x1000, 0x100), (0x3000, 0x100)]
    # a tensor argument inside a block is carved out; one over a block's end cuts it short
    keep = [(0x1040, 0x20), (0x30c0, 0x80), (0x1000, 0)]
    assert canary.scratch_ranges(words, free, keep) == [(0x1000, 0x40), (0x1060, 0xa0), (0x3000, 0xc0)]
    assert canary.scratch_ranges(words, free, [(0x0f00, 0x300)]) == [(0x3000, 0x100)]


def test_load_poisons_scratch_only_inside_libembers_region() -> None:
    """At LOAD the graphs' memory is where libember mapped it: a range outside its region (or
    an archive without one) is never written."""
    ranges = [[0x1000, 0x100], [0x1f00, 0x200], [0x5000, 0x10], [0x1100, 0]]
    assert canary.within(ranges, [0x1000, 0x1000]) == [(0x1000, 0x100)]
    assert canary.within(ranges, None) == [] and canary.within(ranges, [0, 0]) == []


def test_the_poison_reads_as_a_large_value_in_every_float_width_and_as_no_index() -> None:
    """A buffer a faulty kernel leaves poisoned is read downstream as the poison: it must be large
    beside what a random-weight model computes (activations ~1e-3 and below), or the step's result
    rounds to the right one in bf16 and the canary passes the fault."""
    word = bytes([canary.POISON]) * 8
    fp32 = float(np.frombuffer(word[:4], dtype=np.float32)[0])
    bf16 = float(np.frombuffer(b"\0\0" + word[:2], dtype=np.float32)[0])  # bf16: fp32's high half
    fp16 = float(np.frombuffer(word[:2], dtype=np.float16)[0])
    for value in (fp32, bf16, fp16):
        assert np.isfinite(value) and abs(value) >= 100, (value, canary.POISON)
    # as an index (an int32 or int64 buffer read before written), far past any table
    assert int(np.frombuffer(word[:4], dtype=np.int32)[0]) > 1 << 30
    assert int(np.frombuffer(word, dtype=np.int64)[0]) > 1 << 62


def test_a_span_is_inside_only_where_one_span_holds_all_of_it() -> None:
    spans = [(100, 50), (300, 8)]
    assert canary.inside((100, 50), spans) and canary.inside((120, 10), spans)
    assert canary.inside((300, 0), spans)
    assert not canary.inside((140, 20), spans)  # runs past the first
    assert not canary.inside((150, 4), spans) and not canary.inside((96, 8), spans)
    assert not canary.inside((100, 8), [])
