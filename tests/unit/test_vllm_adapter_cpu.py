"""The vLLM adapter's logic without vLLM: key enumeration from a config, version refusal, plugin."""

from __future__ import annotations

import importlib.util
import itertools
import random
from types import SimpleNamespace

import pytest

from ember.engines.vllm import keys, versions
from ember.engines.vllm.keys import FULL, PIECEWISE, GraphConfig


def _cfg(
    mode: str = "FULL_AND_PIECEWISE", seqs: int = 256, tokens: int = 8192, runner: str = "v1", q: int = 1
):
    sizes = keys.default_capture_sizes(seqs, tokens, decode_query_len=q)
    return GraphConfig(mode, tuple(sizes), max(sizes), seqs, decode_query_len=q, runner=runner)


def test_default_capture_sizes_follow_vllm_rule():
    sizes = keys.default_capture_sizes(256, 8192)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512
    assert all(b - a == 8 for a, b in itertools.pairwise(sizes[3:]) if b < 256)
    assert all(b - a == 16 for a, b in itertools.pairwise(sizes) if a >= 256)
    # a small token budget caps the sizes and is captured itself
    small = keys.default_capture_sizes(256, 300)
    assert max(small) == 300 and 288 in small and 304 not in small
    # few sequences: max = 2 * max_num_seqs
    assert max(keys.default_capture_sizes(8, 8192)) == 16
    # explicit sizes: deduplicated, sorted, cut at the token budget
    assert keys.default_capture_sizes(8, 100, explicit=[64, 8, 8, 200, 1]) == [1, 8, 64]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_full_and_piecewise_keys(runner):
    cfg = _cfg(runner=runner)
    descs = keys.enumerate_descs(cfg)
    pw = [d for d in descs if d.mode == PIECEWISE]
    full = [d for d in descs if d.mode == FULL]
    assert [d.num_tokens for d in pw] == sorted(cfg.capture_sizes, reverse=True)
    assert all(d.num_reqs is None and d.uniform == 0 for d in pw)
    # decode graphs: one per size up to max_num_seqs, uniform, one request per token
    assert sorted(d.num_tokens for d in full) == [s for s in cfg.capture_sizes if s <= cfg.max_num_seqs]
    assert all(d.num_reqs == d.num_tokens and d.uniform == 1 for d in full)
    assert descs.index(pw[-1]) < descs.index(full[0])  # PIECEWISE captured first, largest first
    ks = keys.enumerate_keys(cfg, pieces=33)
    assert len(ks) == 33 * len(pw) + len(full) and len(set(ks)) == len(ks)
    site = keys.V2_FULL_GRAPH if runner == "v2" else keys.V1_FULL_ENTRY
    assert {k[0] for k in ks} == {keys.PIECEWISE_ENTRY, site}
    assert all(keys.archive_key(keys.desc_of(k), runner, k[1]) == k for k in ks)


def test_other_modes():
    assert {d.mode for d in keys.enumerate_descs(_cfg("PIECEWISE"))} == {PIECEWISE}
    full = keys.enumerate_descs(_cfg("FULL"))
    assert {d.mode for d in full} == {FULL} and all(d.uniform == 0 for d in full)
    assert [d.num_reqs for d in full if d.num_tokens == 512] == [256]  # requests capped
    decode_only = keys.enumerate_descs(_cfg("FULL_DECODE_ONLY"))
    assert {d.mode for d in decode_only} == {FULL} and all(d.uniform for d in decode_only)
    assert keys.enumerate_descs(_cfg("NONE")) == []
    with pytest.raises(ValueError):
        keys.enumerate_descs(_cfg("SOMETHING"))


def test_v2_speculative_decode_rounds_to_query_length():
    cfg = _cfg(runner="v2", q=3, seqs=16)
    full = [d for d in keys.enumerate_descs(cfg) if d.mode == FULL]
    assert full and all(d.num_tokens % 3 == 0 and d.num_reqs == d.num_tokens // 3 for d in full)
    assert all(d.uniform == 3 and d.num_tokens <= 48 for d in full)


def test_every_schedulable_batch_lands_on_a_key():
    cfg = _cfg(seqs=64, tokens=4096)
    descs = set(keys.enumerate_descs(cfg))
    rng = random.Random(1)
    for _ in range(2000):
        n = rng.randrange(1, max(cfg.capture_sizes) + 1)
        padded = keys.padded_size(cfg, n)
        assert padded is not None and padded >= n
        assert keys.Desc(PIECEWISE, padded, None, 0) in descs
        if padded <= cfg.max_num_seqs:  # a uniform decode batch of n requests
            assert keys.Desc(FULL, padded, padded, 1) in descs
    assert keys.padded_size(cfg, max(cfg.capture_sizes) + 1) is None


def test_graph_config_from_a_vllm_shaped_object():
    vc = SimpleNamespace(
        compilation_config=SimpleNamespace(
            cudagraph_mode=SimpleNamespace(name="FULL_AND_PIECEWISE"),
            cudagraph_capture_sizes=[1, 2, 4, 8],
            max_cudagraph_capture_size=8,
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        num_speculative_tokens=0,
    )
    cfg = GraphConfig.from_vllm(vc, "v2")
    assert cfg == GraphConfig("FULL_AND_PIECEWISE", (1, 2, 4, 8), 8, 4, 1, "v2")
    assert GraphConfig.from_json(cfg.to_json()) == cfg
    # FULL decode graphs only up to max_num_seqs=4
    assert sorted(d.num_tokens for d in keys.enumerate_descs(cfg) if d.mode == FULL) == [1, 2, 4]


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.26.0", True),
        ("0.26.3.post1", True),
        ("0.27.0", False),
        ("0.25.2", False),
        ("1.0.0", False),
        ("dev", False),
    ],
)
def test_version_refusal(version, ok):
    problems = versions.check_version_string(version)
    assert (problems == []) is ok
    if not ok:
        assert version in problems[0]


def _vllm_config(**over):
    pc = dict(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1, use_ubatching=False)
    pc.update(over.pop("parallel", {}))
    return SimpleNamespace(
        parallel_config=SimpleNamespace(**pc),
        compilation_config=SimpleNamespace(use_inductor_graph_partition=False),
        model_config=SimpleNamespace(enforce_eager=False),
        lora_config=over.get("lora"),
        speculative_config=over.get("spec"),
    )


def test_unsupported_features_are_named():
    assert versions.unsupported_features(_vllm_config()) == []
    assert "LoRA" in versions.unsupported_features(_vllm_config(lora=object()))[0]
    # tensor parallel restores on N ranks, with the SAVE's pins; pipeline parallel does not
    tp = versions.unsupported_features(_vllm_config(parallel={"tensor_parallel_size": 2}))
    assert tp and "custom all-reduce" in tp[0]
    pp = versions.unsupported_features(_vllm_config(parallel={"pipeline_parallel_size": 2}))
    assert pp and "pipeline_parallel_size=2" in pp[0]
    assert "speculative" in versions.unsupported_features(_vllm_config(spec=object()))[0]
    # vLLM 0.26's sequence-parallel MoE (EP, TP > 1, DP > 1) chunks tokens at tp_rank * chunk
    sp = versions.unsupported_features(_vllm_config(parallel={"use_sequence_parallel_moe": True}))
    assert sp == ["sequence-parallel MoE (expert parallel with tensor > 1 and data > 1: each TP "
                  "rank's token chunk is a view offset by its rank)"]
    # vLLM's compile through Inductor: only in its deterministic mode (args.NUMERICS), as SAVE compiled
    compiled = _vllm_config()
    compiled.compilation_config = SimpleNamespace(use_inductor_graph_partition=False, mode=3, backend="",
                                                  inductor_compile_config={"combo_kernels": True})
    assert "deterministic mode" in versions.unsupported_features(compiled)[0]
    compiled.compilation_config.inductor_compile_config["deterministic"] = True
    assert versions.unsupported_features(compiled) == []
    compiled.compilation_config.backend = "eager"  # no Inductor: nothing autotuned
    compiled.compilation_config.inductor_compile_config.clear()
    assert versions.unsupported_features(compiled) == []


def test_the_plugin_patches_only_once_the_worker_module_is_imported(monkeypatch, tmp_path):
    """`after_import`: register() defers the touch-point check and the patches to the first import
    of vLLM's GPU worker module, which only worker processes do (not the API server)."""
    import sys

    from ember.engines.vllm import plugin

    pkg = tmp_path / "fakepkg_after_import"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "worker.py").write_text("ORDER = ['module body']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    plugin.after_import("fakepkg_after_import.worker", lambda: seen.append(
        list(sys.modules["fakepkg_after_import.worker"].ORDER)))
    import fakepkg_after_import  # noqa: F401 - the parent alone does not trigger it

    assert seen == []
    from fakepkg_after_import import worker

    assert seen == [["module body"]]  # right after the module body ran, once
    import importlib

    importlib.reload(worker)
    assert seen == [["module body"]] and worker.ORDER == ["module body"]
    assert not any(type(f).__name__ == "_Hook" for f in sys.meta_path)
    monkeypatch.delitem(sys.modules, "fakepkg_after_import.worker")
    monkeypatch.delitem(sys.modules, "fakepkg_after_import")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_register_checks_vllm_only_where_its_worker_is_imported(monkeypatch, tmp_path):
    """A stand-in vLLM 0.26.0 without the touch points: register() in a front-end-like process
    leaves it alone (no check, no report); importing the worker module then runs the check, which
    refuses with the missing touch points and leaves vLLM untouched."""
    import json
    import sys

    from ember.engines.vllm import plugin

    root = tmp_path / "vllm"
    (root / "v1" / "worker").mkdir(parents=True)
    (root / "__init__.py").write_text("__version__ = '0.26.0'\n")
    for d in (root / "v1", root / "v1" / "worker"):
        (d / "__init__.py").write_text("")
    (root / "v1" / "worker" / "gpu_worker.py").write_text("class Worker: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugin, "STATE", plugin._State())
    monkeypatch.delenv("EMBER_MODE", raising=False)
    monkeypatch.delenv("EMBER_VLLM_REPORT", raising=False)
    plugin.register()  # off: nothing at all
    assert not plugin.STATE.installed
    report = tmp_path / "r.json"
    monkeypatch.setenv("EMBER_MODE", "load")
    monkeypatch.setenv("EMBER_VLLM_REPORT", str(report))
    try:
        plugin.register()
        plugin.register()  # re-entrant: one hook
        assert sum(type(f).__name__ == "_Hook" for f in sys.meta_path) == 1
        assert plugin.STATE.installed and not plugin.STATE.refusal and not report.exists()
        import vllm.v1.worker.gpu_worker  # noqa: F401 - what a worker process does

        assert "GPUModelRunner.capture_model is missing" in plugin.STATE.refusal
        assert json.loads(report.read_text())["stages"]["refused"]["note"] == "vLLM left untouched"
    finally:
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_Hook"]


def test_a_failing_install_is_a_refusal_not_a_failed_import(monkeypatch, tmp_path):
    """`_install` runs inside vLLM's import of its worker module: an exception there (a touch
    point that breaks when patched) is reported as a refusal; vLLM's import goes on."""
    import json

    from ember.engines.vllm import plugin, versions

    def broken() -> list[str]:
        raise RuntimeError("touch point moved")

    monkeypatch.setattr(plugin, "STATE", plugin._State())
    monkeypatch.setattr(versions, "check_engine", broken)
    monkeypatch.setenv("EMBER_VLLM_REPORT", str(tmp_path / "r.json"))
    plugin._install()  # must not raise
    assert "RuntimeError: touch point moved" in plugin.STATE.refusal
    assert json.loads((tmp_path / "r.json").read_text())["stages"]["refused"]["note"] == "vLLM left untouched"


def test_a_load_told_to_capture_natively_refuses_its_archive_and_vllm_captures(monkeypatch, tmp_path):
    """The bench's reference (EMBER_VLLM_CAPTURE_NATIVELY): a LOAD set up as ever lets go of the
    opened archive and vLLM captures, reported as a refusal with its reason."""
    import json
    import sys
    import types

    from ember.engines.vllm import plugin, report

    fake_torch = types.ModuleType("torch")  # _load imports torch; nothing of it runs on this path
    fake_torch.distributed = SimpleNamespace(is_available=lambda: False)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    path = tmp_path / "vllm-report.json"
    monkeypatch.setenv("EMBER_VLLM_REPORT", str(path))
    monkeypatch.setenv("EMBER_VLLM_CAPTURE_NATIVELY", "1")
    abandoned: list[bool] = []
    monkeypatch.setattr(plugin.STATE, "restore", SimpleNamespace(abandon=lambda: abandoned.append(True)))
    one = SimpleNamespace(tensor_parallel_size=1, data_parallel_size=1, pipeline_parallel_size=1)
    runner = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=one))
    assert plugin._load(runner, "v1", lambda: 7) == 7  # what vLLM's own capture returned
    stages = report.read(path)["stages"]
    assert abandoned == [True] and stages["capture"]["how"] == "native-after-refusal"
    assert "EMBER_VLLM_CAPTURE_NATIVELY" in json.dumps(stages["load_refused"])


def _engine(tensor: int, data: int, expert: bool) -> SimpleNamespace:
    """A vLLM config as one engine resolved it (a dense model's DP replica has DP 1)."""
    return SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name="FULL_AND_PIECEWISE"),
                                           cudagraph_capture_sizes=[1, 2, 4, 8],
                                           max_cudagraph_capture_size=8),
        scheduler_config=SimpleNamespace(max_num_seqs=4), num_speculative_tokens=0,
        parallel_config=SimpleNamespace(tensor_parallel_size=tensor, data_parallel_size=data,
                                        pipeline_parallel_size=1, enable_expert_parallel=expert))


@pytest.mark.parametrize(("engine", "archive", "ok"), [
    ((1, 1, False), {"tensor": 1, "expert": 1, "data": 1}, True),  # a dense DP replica, the one-GPU archive
    ((1, 1, False), None, True),  # an archive from before the facts named the world: one GPU
    ((1, 2, False), {"tensor": 1, "expert": 1, "data": 1}, False),  # MoE DP without EP: one world of 2
    ((1, 2, False), None, False),
    ((1, 2, True), {"tensor": 1, "expert": 2, "data": 2}, True),
    ((1, 2, True), {"tensor": 1, "expert": 1, "data": 1}, False),
])
def test_load_accepts_only_an_archive_of_the_world_this_engine_runs(
    engine: tuple[int, int, bool], archive: dict | None, ok: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A one-GPU archive has no collective to splice: served to ranks that all-reduce across DP
    (a MoE model's DP ranks without EP, which the operator names by the data-1 identity too), its
    graphs would compute each rank's part alone. LOAD refuses it before anything is restored."""
    from ember.engines.vllm import adapter as vadapter
    from ember.runtime.adapter import Refused

    monkeypatch.setattr(vadapter, "engine_version", lambda: "0.26.0")
    a = vadapter.VllmAdapter(vllm_config=_engine(*engine), runner_kind="v2")
    facts = {"kind": "vllm", "version": "0.26.0", "runner": "v2", "graph_config": a.graph_config().to_json(),
             "kv_cache_memory_bytes": 1 << 30, **({"parallelism": archive} if archive else {})}
    if ok:
        assert a.accept(facts)["kind"] == "vllm"
    else:
        with pytest.raises(Refused, match="archive is for the world"):
            a.accept(facts)


@pytest.mark.parametrize(("engine", "archived"), [
    ((1, 1, False), {"tensor": 1, "expert": 1, "data": 1}),
    ((2, 1, False), {"tensor": 2, "expert": 1, "data": 1}),
    ((1, 2, False), {"tensor": 1, "expert": 1, "data": 1}),  # DP without EP: data 1's archive
    ((1, 2, True), {"tensor": 1, "expert": 2, "data": 2}),
])
def test_a_standalone_identity_names_its_archived_shape_and_embers_workload(
    engine: tuple[int, int, bool], archived: dict[str, int], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without an operator (no EMBER_IDENTITY) the engine names its archive itself: the shape and
    ember's compile and canary settings are in it as in the operator's, so an archive SAVEd before
    the canary changed, or for another shape, is not found under it."""
    import sys

    from ember import contract
    from ember.engines.vllm import adapter as vadapter
    from ember.engines.vllm.args import IDENTITY_WORKLOAD

    monkeypatch.setattr(vadapter, "engine_version", lambda: "0.26.0")
    torch = SimpleNamespace(cuda=SimpleNamespace(get_device_name=lambda: "H200"))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.delenv(contract.ENV_IDENTITY, raising=False)
    cfg = _engine(*engine)
    cfg.model_config = SimpleNamespace(model="/models/qwen3-moe/", revision=None, dtype="torch.bfloat16",
                                       hf_config=SimpleNamespace(to_dict=lambda: {"num_hidden_layers": 2}))
    cfg.scheduler_config.max_num_batched_tokens = 2048
    cfg.compute_hash = lambda: "c0ffee"

    ident = vadapter.VllmAdapter(vllm_config=cfg, runner_kind="v2").identity()
    assert ident.model == "qwen3-moe" and ident.dtype == "bfloat16"
    assert ident.parallelism.model_dump() == archived
    assert ident.workload == IDENTITY_WORKLOAD and ident.workload["canary"]


@pytest.mark.parametrize(("tensor", "limit"), [(1, 0.0), (2, 120.0)])
def test_the_canary_of_several_ranks_is_bounded_so_no_peer_waits_for_nccls_timeout(
        tensor: int, limit: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """N ranks: the canary and its vote run under `exit_if_stuck(EMBER_VLLM_CANARY_TIMEOUT_S)` (a
    rank that failed between two collectives would leave its peers in the next one); one GPU has
    no peer to wait for. The verdict is still every rank's."""
    import contextlib
    import sys
    import types

    from ember.engines.vllm import adapter as vadapter
    from ember.runtime import stacks

    bounds: list[float] = []
    inside: list[bool] = []

    @contextlib.contextmanager
    def bounded(after: float):
        bounds.append(after)
        inside.append(True)
        yield
        inside.append(False)

    def run(*_a):  # the canary, and where it ran
        assert inside[-1]
        return {"ok": True, "why": "", "checked": ["piecewise:template"], "parts_ms": {}, "verify_ms": 1.0}

    monkeypatch.setattr(stacks, "exit_if_stuck", bounded)
    stand_in = types.SimpleNamespace(run=run)
    monkeypatch.setitem(sys.modules, "ember.engines.vllm.canary_run", stand_in)
    # `from ember.engines.vllm import canary_run` reads the package's attribute first (set where an
    # earlier test imported the real module: torch installed)
    monkeypatch.setattr(sys.modules["ember.engines.vllm"], "canary_run", stand_in, raising=False)
    a = vadapter.VllmAdapter(vllm_config=_engine(tensor, 1, False), runner_kind="v2")
    votes: list[bool] = []
    monkeypatch.setattr(a, "_agree", lambda ok: votes.append(inside[-1]) or ok)
    monkeypatch.setattr(a, "rank", lambda: 0)
    a._facts = {}
    assert a.verify(object())["verify_ms"] == 1.0  # type: ignore[arg-type]
    assert bounds == [limit] and inside[-1] is False
    assert votes == ([True] if tensor > 1 else [])  # the vote is inside the bound too


def test_a_rank_failing_inside_the_canary_still_votes_inside_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`EMBER_FAULT=canary-raise` (tests): rank 1 raises before its canary's first step. It is a
    refusal on that rank, and its vote still comes, inside the bound (its peers wait in the
    canary's collective it left: on the GPU, the bound ends them all, tests/gpu/test_vllm_canary.py)."""
    import contextlib
    import sys
    import types

    from ember.engines.vllm import adapter as vadapter
    from ember.runtime import stacks
    from ember.runtime.adapter import Refused

    inside: list[bool] = [False]

    @contextlib.contextmanager
    def bounded(after: float):
        inside.append(True)
        yield
        inside.append(False)

    def run(*_a):
        raise AssertionError("rank 1 never runs the canary under the fault")

    monkeypatch.setenv("EMBER_FAULT", "canary-raise")
    monkeypatch.setattr(stacks, "exit_if_stuck", bounded)
    stand_in = types.SimpleNamespace(run=run)
    monkeypatch.setitem(sys.modules, "ember.engines.vllm.canary_run", stand_in)
    monkeypatch.setattr(sys.modules["ember.engines.vllm"], "canary_run", stand_in, raising=False)
    a = vadapter.VllmAdapter(vllm_config=_engine(2, 1, False), runner_kind="v2")
    votes: list[tuple[bool, bool]] = []
    monkeypatch.setattr(a, "_agree", lambda ok: votes.append((ok, inside[-1])) or ok)
    monkeypatch.setattr(a, "rank", lambda: 1)
    a._facts = {}
    with pytest.raises(Refused, match="injected fault canary-raise"):
        a.verify(object())  # type: ignore[arg-type]
    assert votes == [(False, True)]
