"""CPU: the proof's torch-free logic (edge data strictness, native spread, suspects) and the
benchmark's token verdicts with their native controls."""

from __future__ import annotations

from ember.archive.graphs import Edge, Graph, GraphSet, KernelParams, KernelRef, Node, NodeType
from ember.runtime.proof import measures as pm
from ember_bench.graphs import outputs_goal, token_verdicts, tokens_goal


def test_programmatic_edge_rebuilt_as_default_is_a_difference() -> None:
    captured = [Edge(0, 1), Edge(1, 2, from_port=1, type=1)]
    assert pm.edge_problems(captured, [Edge(1, 2, from_port=1, type=1), Edge(0, 1)]) == []
    (p,) = pm.edge_problems(captured, [Edge(0, 1), Edge(1, 2)])
    assert p.startswith("edge data differs") and "programmatic 0 rebuilt vs 1 captured" in p
    (p,) = pm.edge_problems(captured, [Edge(0, 1)])
    assert p.startswith("edges differ: 1 rebuilt vs 2 captured")


def test_spread_is_the_largest_pairwise_deviation() -> None:
    assert pm.spread_of([[0.0, 0.0], [0.0, 0.0]], 2) == [0.0, 0.0]
    assert pm.spread_of([[0.5, 0.0], [0.25, 3.0]], 2) == [0.5, 3.0]


def test_within_spread_uses_the_nearest_native_and_requires_exactness_where_stable() -> None:
    spread = [0.5, 0.0]  # logits vary natively by up to 0.5; tokens are bit-stable
    assert pm.within_spread([[0.9, 0.0], [0.4, 0.0]], spread) == (True, [0.4, 0.0])
    ok, nearest = pm.within_spread([[1.5, 0.0], [1.2, 0.0]], spread)
    assert not ok and nearest == [1.2, 0.0]  # beyond 2x the native spread
    assert not pm.within_spread([[0.1, 1.0], [0.1, 1.0]], spread)[0]  # a stable output differs
    assert pm.within_spread([[0.0, 0.0]], [0.0, 0.0]) == (True, [0.0, 0.0])


def _k(kernel: int) -> Node:
    return Node(NodeType.KERNEL, KernelParams(kernel=kernel, grid=(1, 1, 1), block=(1, 1, 1), shared_mem=0))


def test_suspects_are_kernels_only_unstable_graphs_use() -> None:
    refs = [KernelRef("a" * 16, "rmsnorm"), KernelRef("b" * 16, "gemm_splitk"), KernelRef("c" * 16, "gemm")]
    gs = GraphSet(
        [
            Graph((1,), [_k(0), _k(2)], []),
            Graph((16,), [_k(0), _k(1)], []),
            Graph((24,), [_k(0), _k(1), _k(2)], []),
        ],
        refs,
        [],
    )
    assert pm.suspect_kernels(gs, {(16,), (24,)}) == ["gemm_splitk"]
    assert pm.suspect_kernels(gs, set()) == []


def test_step_hashes_and_first_divergence() -> None:
    a = pm.step_hashes([b"\x01\x02", b"\x03\x04", b"\x05\x06"])
    b = pm.step_hashes([b"\x01\x02", b"\x03\x05", b"\x05\x06"])
    assert len(a) == 3 and len(set(a)) == 3
    assert pm.first_divergence(a, a) is None
    assert pm.first_divergence(a, b) == 1
    assert pm.first_divergence(a, a[:2]) == 2
    assert pm.first_divergence(None, a) is None


def _runs(native: str, again: str, save: str, loaded: str) -> tuple[dict, dict]:
    steps = {x: [x] * 4 for x in "abcd"}
    nat = {
        "decode_sha256": {"8": native},
        "decode_steps": {"8": steps[native]},
        "decode_repeat_identical": {"8": native == again},
    }
    load = {
        "decode_sha256": {"8": loaded},
        "decode_steps": {"8": steps[loaded]},
        "saved_decode_sha256": {"8": save},
        "saved_decode_steps": {"8": steps[save]},
    }
    return nat, load


def _verdict(*shas: str) -> tuple[dict, bool | None]:
    r = token_verdicts(*_runs(*shas))
    return r, tokens_goal(r)


def test_tokens_identical_when_all_agree() -> None:
    r, goal = _verdict("a", "a", "a", "a")
    assert r["tokens_identical"] == {"8": True} and goal is True
    assert r["tokens_verdict"]["8"] == "identical"


def test_restore_failure_only_when_the_native_controls_agree() -> None:
    r, goal = _verdict("a", "a", "a", "b")
    assert goal is False and r["tokens_verdict"]["8"].startswith("RESTORE DIFFERS")
    assert r["tokens_first_divergence"]["8"]["restored_vs_save"] == 0


def test_native_not_reproducible_is_not_a_restore_verdict() -> None:
    for shas in (("a", "a", "c", "b"), ("a", "c", "a", "b")):  # across processes / within one
        r, goal = _verdict(*shas)
        assert goal is None, shas
        assert "not reproducible" in r["tokens_verdict"]["8"]


def test_outputs_goal_fails_on_restored_differences_native_does_not_have() -> None:
    rep = {"graphs": 67, "identical": 33, "differ": ["136", "144"]}
    assert outputs_goal({"outputs_identical_vs_save": rep,
                          "outputs_control_native_vs_save": {"identical": 67, "differ": []}}) is False
    # where two native processes disagree on a key, a restored difference there is no verdict
    rep = {"graphs": 67, "identical": 65, "differ": ["40", "200"]}
    control = {"identical": 65, "differ": ["40", "200"]}
    r = {"outputs_identical_vs_save": rep, "outputs_control_native_vs_save": control}
    assert outputs_goal(r) is True
    assert outputs_goal({}) is None


def test_proof_facts_are_json_safe() -> None:
    import json

    import pytest

    save = pytest.importorskip("ember.runtime.save")  # imports torch
    facts = save._finite({"k": [float("inf"), 1.0, (2.0,)]})
    assert json.loads(json.dumps(facts, allow_nan=False)) == {"k": ["inf", 1.0, [2.0]]}


def test_load_stages_line_names_the_critical_path_the_background_and_the_controls() -> None:
    from ember_bench.graphs import stages_cell

    r = {
        "load_timings": {"read_ms": 5.2, "replay_window_ms": 0.3, "join_ms": 0.02,
                         "reconstruct_ms": 5286.0, "templates_ms": 2708.0, "templates_threads": 1},
        "tpot_save_ms": {"1": 9.5},
        "tpot_template_ms": {"1": 9.6},
        "tpot_reinstantiated_ms": {"64": 12.25},
        "cold_start_s": {"native": 11.61, "restored": 6.27, "native_build_s": 4.74, "restored_build_s": 6.26},
    }
    line = stages_cell(r)
    assert line.startswith("read 5, replay_window 0, join 0, reconstruct 5286, templates 2708")
    assert "threads" not in line  # counts are not stages
    assert "captured graphs (libember memory) 9.500 (1)" in line
    assert "updated template (a key's first steps) 9.600 (1)" in line
    assert "instantiated by ember instead of torch 12.250 (64)" in line
    assert "cold start native 11.61 s (build 4.74) vs restored 6.27 s (build 6.26)" in line
    assert "redone after the replay" not in line
    r["load_timings"]["background_error"] = "CudaError: cuGraphInstantiate"
    assert "background build refused, redone after the replay: CudaError" in stages_cell(r)


def test_the_report_names_unions_and_the_topology_groups_they_replace() -> None:
    from ember_bench.graphs import groups_cell

    assert groups_cell({"groups": 26, "union_templates": 2, "topology_groups": 32}) == (
        "26 (2 unions; 32 topology groups)")
    assert groups_cell({"groups": 32, "union_templates": 0, "topology_groups": 32}) == "32"
    assert groups_cell({"groups": 25}) == "25"  # a report from before unions
