"""CPU: `ember bench vllm --tp/--ep/--dp` names its shapes, builds the deployment's identity and
reads each rank's figures from the plugin's report files; each batch's requests are scheduled
together."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer

from ember.engines.vllm import report
from ember_bench import vllm_parallel as vp
from ember_bench.vllm import bench_vllm


def test_shapes_and_their_identity(tmp_path: Path) -> None:
    assert vp.shape_name(2, False, 1) == "tp2" and vp.shape_name(2, True, 1) == "tp2-ep2"
    assert vp.shape_name(1, True, 2) == "ep2-dp2"
    ident = vp.shape_identity(tmp_path, 1, True, 2)
    assert ident.parallelism.model_dump() == {"tensor": 1, "expert": 2, "data": 2}


def test_each_ranks_figures_come_from_its_report_file(tmp_path: Path) -> None:
    path = tmp_path / "vllm-report.json"
    report.write(path, {"stages": {"load": {"graphs": 9, "timings": {"splice_now_ms": 4.2}},
                                   "capture": {"how": "restored", "seconds": 0.8},
                                   "worker.load_model": {"seconds": 3.1}}}, (0, 2))
    refused = {"capture": {"how": "native-after-refusal", "seconds": 9.0},
               "load_refused": {"reason": "load: a peer rank refused the archive"}}
    report.write(path, {"stages": refused}, (1, 2))
    ranks = vp.per_rank({"ember": report.read(path)})
    assert ranks["0"]["capture_how"] == "restored" and ranks["0"]["splice_ms"] == 4.2
    assert ranks["0"]["worker_stages_s"] == {"load_model": 3.1} and ranks["0"]["graphs"] == 9
    assert ranks["1"]["refusal"] == "load: a peer rank refused the archive"


def test_a_save_run_without_native_before_it_is_refused_before_any_engine_starts(tmp_path: Path) -> None:
    """SAVE takes native's KV-cache size: without it the plugin refuses SAVE and vLLM captures
    natively, which the bench would have timed as a SAVE."""
    for runs in ("save", "save,native", "save,load"):
        with pytest.raises(typer.BadParameter, match="save needs native before it"):
            bench_vllm(runs=runs, work=tmp_path, out_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # no config written, no engine started


def test_the_summary_holds_each_goals_ratio_and_the_tp1_save_it_is_measured_against(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No engine: the runs are stand-ins, so what is checked is which identity each SAVE gets and
    how the summary's ratios come from the runs."""
    saves: list[dict] = []
    flaky = [False]  # native's second run repeats its tokens, or not

    def engine(mode: str, *a, name: str = "", **kw) -> dict:
        tokens = [[6]] if flaky[0] and name == "native-again" else [[5]]
        return {"engine_init_s": {"native": 40.0, "load": 6.0}[mode], "tokens": {"1": tokens}}

    def save(ident, extra, work, timeout) -> dict:
        saves.append(ident.parallelism.model_dump())
        return {"published": True, "save_job_s": 90.0 if ident.parallelism.tensor == 2 else 60.0}

    monkeypatch.setattr(vp, "run_engine", engine)
    monkeypatch.setattr(vp, "run_save", save)
    monkeypatch.setattr("ember_bench.vllm_report._device", lambda: "gpu")
    out = vp.bench_parallel("llama-3-8b", 2, 2, False, 1, work=tmp_path, out_dir=tmp_path / "out",
                            batch_sizes=[1], max_tokens=2, gpu_memory_utilization=0.4, timeout=9)
    summary = json.loads(out.read_text())["summary"]
    assert saves == [{"tensor": 2, "expert": 1, "data": 1}, {"tensor": 1, "expert": 1, "data": 1}]
    assert summary["engine_init_load_over_native"] == 0.15 and summary["tokens_identical_to_native"]
    assert summary["native_reproducible"]
    assert summary["save_job_s_tp1"] == 60.0 and summary["save_over_tp1_save"] == 1.5
    saves.clear()
    flaky[0] = True
    out = vp.bench_parallel("llama-3-8b", 2, 2, False, 1, work=tmp_path, out_dir=tmp_path / "out",
                            batch_sizes=[1], max_tokens=2, gpu_memory_utilization=0.4, timeout=9,
                            tp1_save=False)
    summary = json.loads(out.read_text())["summary"]
    assert len(saves) == 1 and summary["save_over_tp1_save"] is None
    assert summary["tokens_identical_to_native"] and not summary["native_reproducible"]


def test_tp1_with_loads_runs_a_pods_path_on_one_gpu_with_one_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--loads N` (or `--floor`) without a parallel flag: the pod's path at a world of one, N
    LOADs of one SAVE, and no second SAVE at TP=1 to hold it to (it is the TP=1 SAVE)."""
    from ember_bench import vllm as bench

    runs: list[str] = []
    saves: list[dict] = []

    def engine(mode: str, *a, name: str = "", **kw) -> dict:
        runs.append(name or mode)
        i = len(runs)  # each LOAD's own init and canary; the floor captured for 0.5 s
        how = {"how": "restored" if mode == "load" else "native", "seconds": 0.5}
        report = {"stages": {"capture": how, "verify": {"ok": True, "verify_ms": 10.0 * i}}}
        init = {"native": 40.0, "load": 6.0 if name in ("load", "reference") else 4.0 + i}[mode]
        return {"engine_init_s": init, "tokens": {"1": [[5]]}, "ember": report}

    def save(ident, extra, work, timeout) -> dict:
        saves.append(ident.parallelism.model_dump())
        return {"published": True, "save_job_s": 60.0}

    monkeypatch.setattr(vp, "run_engine", engine)
    monkeypatch.setattr(vp, "run_save", save)
    monkeypatch.setattr("ember_bench.vllm_report._device", lambda: "gpu")
    bench.bench_vllm(model="llama-3-8b", layers=2, work=tmp_path, out_dir=tmp_path / "out", loads=3,
                     floor=True, batch_sizes="1", max_tokens=2)
    assert saves == [{"tensor": 1, "expert": 1, "data": 1}]
    assert runs == ["native", "floor", "load", "load-1", "load-2", "reference", "native-again"]
    summary = json.loads((tmp_path / "out" / "vllm-gpu-llama-3-8b-tp1.json").read_text())["summary"]
    assert summary["engine_init_load_over_native"] == 0.15 and summary["save_over_tp1_save"] is None
    # the one report is rank 0's: the floor is less its capture, the canary counted per LOAD
    assert summary["engine_init_floor_s"] == 39.5 and summary["loads_restored_every_rank"] == 3
    assert summary["ranks"]["load"]["0"]["capture_how"] == "restored"
    assert summary["engine_init_s_loads"] == {"min": 6.0, "median": 8.0, "max": 9.0}
    assert summary["verify_ms_loads"] == {"min": 30.0, "median": 40.0, "max": 50.0}


def test_a_ratio_with_a_missing_side_is_none() -> None:
    assert vp.ratio(3, 4) == 0.75 and vp.ratio(None, 4) is None and vp.ratio(3, 0) is None


class _Engine:
    """An async engine stand-in that records the order of calls; outputs finish after two puts."""

    def __init__(self, fail_at: int = -1) -> None:
        self.calls: list[str] = []
        self.fail_at = fail_at

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(f"pause:{mode}:{clear_cache}")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def add_request(self, rid: str, prompt: dict, params: object,
                          data_parallel_rank: int | None = None) -> asyncio.Queue:
        if len([c for c in self.calls if c.startswith("add")]) == self.fail_at:
            raise RuntimeError("engine dead")
        self.calls.append(f"add:{rid}" + ("" if data_parallel_rank is None else f"@dp{data_parallel_rank}"))
        q: asyncio.Queue = asyncio.Queue()
        ids = prompt["prompt_token_ids"]
        for done in (False, True):  # a partial output, then the finished one
            q.put_nowait(SimpleNamespace(finished=done, outputs=[SimpleNamespace(token_ids=ids[: 1 + done])]))
        return q


def test_a_batchs_requests_are_all_added_while_the_scheduler_is_paused() -> None:
    from ember_bench.vllm_child import generate_together

    llm = _Engine()
    batch = [{"prompt_token_ids": [i, i + 1, i + 2]} for i in (10, 20, 30)]
    tokens = asyncio.run(generate_together(llm, batch, None, "b3"))
    assert llm.calls == ["pause:keep:False", "add:b3-0", "add:b3-1", "add:b3-2", "resume"]
    assert tokens == [[10, 11], [20, 21], [30, 31]]  # each request's finished output, in order

    to_one = _Engine()
    asyncio.run(generate_together(to_one, batch[:2], None, "b2", dp_rank=1))
    assert to_one.calls[1:3] == ["add:b2-0@dp1", "add:b2-1@dp1"]

    failing = _Engine(fail_at=1)
    with pytest.raises(RuntimeError, match="engine dead"):
        asyncio.run(generate_together(failing, batch, None, "b3"))
    assert failing.calls[-1] == "resume"  # never left paused


def _published_bench(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engine: object, loads: int,
                     diagnose: bool = False, floor: bool = False) -> dict:
    """A TP=2 bench whose SAVE published, its engines `engine`; the summary."""
    monkeypatch.setattr(vp, "run_engine", engine)
    monkeypatch.setattr(vp, "run_save", lambda *a: {"published": True, "save_job_s": 9.0,
                                                    "args": ["--seed", "0", "--kv-cache-memory-bytes", "77"]})
    monkeypatch.setattr("ember_bench.vllm_report._device", lambda: "gpu")
    out = vp.bench_parallel("llama-3-8b", 2, 2, False, 1, work=tmp_path, out_dir=tmp_path / "out",
                            batch_sizes=[1], max_tokens=2, gpu_memory_utilization=0.4, timeout=9,
                            tp1_save=False, loads=loads, diagnose=diagnose, floor=floor)
    return json.loads(out.read_text())["summary"]


def test_several_fresh_loads_are_each_counted_restored_or_not_and_right_or_wrong(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--loads 4`: the second LOAD refused on rank 1, the third served another token."""
    def rank(how: str) -> dict:
        return {"world": 2, "stages": {"capture": {"how": how}}}

    names: list[str] = []

    def engine(mode: str, *a, name: str = "", **kw) -> dict:
        names.append(name or mode)
        restored = {"ranks": {"0": rank("restored"), "1": rank("native" if name == "load-1" else "restored")}}
        return {"engine_init_s": 5.0, "tokens": {"1": [[7 if name == "load-2" else 5]]},
                "ember": restored if mode == "load" else {}, "triton_compiled": 26 if name == "load-3" else 0}

    summary = _published_bench(monkeypatch, tmp_path, engine, loads=4)
    assert summary["triton_compiled"]["load"] == 0 and summary["triton_compiled_loads"] == [0, 0, 0, 26]
    assert names == ["native", "load", "load-1", "load-2", "load-3", "reference", "native-again"]
    assert summary["failed_loads"] == 0  # each served tokens, right or wrong
    assert summary["loads"] == 4 and summary["loads_restored_every_rank"] == 3
    assert summary["wrong_loads"] == 1 and summary["restored_every_rank"] and summary["native_reproducible"]
    assert summary["wrong_loads_vs_reference"] == 1 and summary["reference_identical_to_native"]
    assert summary["loads_agree"] is False  # load-2 served another token than the others


def test_loads_that_serve_their_own_native_tokens_are_told_from_a_restore_that_changed_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every LOAD serves what the same pod computes with the graphs vLLM captures (the
    reference), and that differs from native's own compile: wrong against native, right against
    the reference. The reference is a LOAD told to capture, native and native again compile from
    an empty cache root."""
    calls: list[tuple[str, str, dict, bool]] = []

    def engine(mode: str, args, work, extra: dict, *a, name: str = "", fresh: bool = False, **kw) -> dict:
        calls.append((mode, name or mode, extra, fresh))
        native = mode == "native"
        restored = {"ranks": {"0": {"world": 1, "stages": {"capture": {"how": "restored"}}}}}
        tokens = {"1": [[5 if native else 6]]}
        init = {"native": 40.0, "reference": 8.0}.get(name or mode, 2.0)
        return {"engine_init_s": init, "tokens": tokens, "ember": {} if native else restored}

    summary = _published_bench(monkeypatch, tmp_path, engine, loads=3)
    assert summary["wrong_loads"] == 3 and summary["wrong_loads_vs_reference"] == 0 and summary["loads_agree"]
    assert summary["reference_identical_to_native"] is False and summary["native_reproducible"]
    assert summary["engine_init_load_over_native"] == 0.05  # 2 s of 40
    assert summary["engine_init_load_over_reference"] == 0.25  # of the reference's 8 s: the graphs' part
    ref = next(c for c in calls if c[1] == "reference")
    assert ref[0] == "load" and ref[2]["EMBER_VLLM_CAPTURE_NATIVELY"] == "1" and ref[2]["EMBER_VLLM_ARCHIVE"]
    assert [c[3] for c in calls if c[0] == "native"] == [True, True]


def test_diagnose_runs_saves_code_in_plain_vllm_and_a_pods_set_up_compiling_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The LOADs serve the reference's tokens, not native's: plain vLLM on SAVE's code serves
    them too, a LOAD without an archive serves native's. So SAVE's code is where they part."""
    calls: dict[str, tuple[str, dict, object]] = {}
    engine_args: dict[str, list[str]] = {}

    def engine(mode: str, args, work, extra: dict, *a, name: str = "", seed: Path | None = None,
               **kw) -> dict:
        calls[name or mode], engine_args[name or mode] = (mode, extra, seed), args
        own = (name or mode) in ("native", "native-again", "load-unarchived", "native-kv-bytes")
        return {"engine_init_s": 3.0, "tokens": {"1": [[5 if own else 6]]}, "ember": {}}

    summary = _published_bench(monkeypatch, tmp_path, engine, loads=1, diagnose=True)
    assert list(calls) == ["native", "load", "reference", "native-save-code", "load-unarchived",
                           "native-kv-bytes", "native-again"]
    assert engine_args["native-kv-bytes"] == [*engine_args["native"], "--kv-cache-memory-bytes", "77"]
    mode, extra, seed = calls["native-save-code"]
    assert mode == "native" and seed == tmp_path / "llama-3-8b-2l-tp2" / "vllm-cache-save" and not extra
    mode, extra, seed = calls["load-unarchived"]
    assert mode == "load" and "EMBER_VLLM_ARCHIVE" not in extra and seed is None
    assert summary["identical_to_native"] == {"native_save_code": False, "load_unarchived": True,
                                              "native_kv_bytes": True}
    assert vp.kv_bytes_args({"args": ["--seed", "0"]}) == [] and vp.kv_bytes_args({}) == []
    assert _published_bench(monkeypatch, tmp_path, engine, loads=1)["identical_to_native"] == {}
    monkeypatch.setenv("EMBER_VLLM_MEGA_AOT", "1")  # SAVE stored one AOT artifact: this run loads it so
    _published_bench(monkeypatch, tmp_path, engine, loads=1, diagnose=True)
    assert calls["native-save-code"][1] == {"VLLM_USE_MEGA_AOT_ARTIFACT": "1",
                                            "VLLM_USE_STANDALONE_COMPILE": "1"}


def test_a_pods_set_up_that_changes_tokens_is_split_into_libember_and_one_gpu_per_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, dict] = {}

    def engine(mode: str, args, work, extra: dict, *a, name: str = "", **kw) -> dict:
        calls[name or mode] = extra
        own = (name or mode) in ("native", "native-again", "load-unarchived-all-gpus")
        return {"engine_init_s": 3.0, "tokens": {"1": [[5 if own else 6]]}, "ember": {}}

    summary = _published_bench(monkeypatch, tmp_path, engine, loads=1, diagnose=True)
    assert calls["load-unarchived-all-gpus"] == {"EMBER_VLLM_ONE_GPU": "0"}
    assert summary["identical_to_native"]["load_unarchived"] is False
    assert summary["identical_to_native"]["load_unarchived_all_gpus"] is True  # one GPU per worker, then


def test_the_floor_is_vllms_warm_start_sized_as_a_pod_less_its_slowest_ranks_capture(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, tuple[list[str], object]] = {}

    def rank(seconds: float) -> dict:
        return {"world": 2, "stages": {"capture": {"how": "native", "seconds": seconds}}}

    def engine(mode: str, args, work, extra: dict, *a, name: str = "", seed: Path | None = None,
               **kw) -> dict:
        calls[name or mode] = (args, seed)
        ember = {"ranks": {"0": rank(0.5), "1": rank(2.0)}} if name == "floor" else {}
        return {"engine_init_s": {"native": 50.0, "floor": 14.0}.get(name or mode, 12.0), "ember": ember,
                "import_s": 20.0 if mode == "native" else 21.0, "tokens": {"1": [[5]]}}

    summary = _published_bench(monkeypatch, tmp_path, engine, loads=1, floor=True)
    assert list(calls) == ["native", "floor", "load", "reference", "native-again"]  # before native again
    args, seed = calls["floor"]
    assert args == [*calls["native"][0], "--kv-cache-memory-bytes", "77"]  # compiled, as native
    assert seed == tmp_path / "llama-3-8b-2l-tp2" / "vllm-cache-native-fresh"  # native's code and kernels
    assert summary["engine_init_floor_s"] == 12.0 and summary["engine_init_floor_over_native"] == 0.24
    assert summary["engine_init_load_over_warm_native"] == round(12.0 / 14.0, 3)
    assert summary["engine_init_load_over_native"] == 0.24
    assert summary["import_s"] == {"native": 20.0, "load": 21.0}  # within start → first token
    plain = _published_bench(monkeypatch, tmp_path, engine, loads=1)
    assert plain["engine_init_floor_s"] is None and plain["engine_init_load_over_warm_native"] is None


def test_a_warm_start_finds_the_kernels_a_cold_start_left_in_inductors_directory(tmp_path: Path) -> None:
    from ember_bench.vllm_parallel import seed_triton_home

    inductor = tmp_path / "torch_compile_cache" / "torch_aot_compile" / "a35" / "inductor_cache" / "triton"
    for device, kernel in (("0", "DLHQ"), ("0", "KPTW"), ("1", "DLHQ")):  # one kernel in two places
        (inductor / device / kernel).mkdir(parents=True)
        (inductor / device / kernel / f"__grp__{kernel}.json").write_text(device)
    home = tmp_path / "triton-home" / ".triton" / "cache"
    (home / "KPTW").mkdir(parents=True)
    (home / "KPTW" / "own.json").write_text("kept")
    assert seed_triton_home(tmp_path) == 1  # KPTW was there already
    assert sorted(p.name for p in home.iterdir()) == ["DLHQ", "KPTW"]
    assert (home / "DLHQ" / "__grp__DLHQ.json").read_text() == "0"
    assert [p.name for p in (home / "KPTW").iterdir()] == ["own.json"]
    assert seed_triton_home(tmp_path) == 0


FAKE_VLLM = {  # just what the engine child imports, an engine that records its prompts' ids
    "vllm/__init__.py": "class SamplingParams:\n    def __init__(self, **kw): self.__dict__.update(kw)\n",
    "vllm/engine/__init__.py": "",
    "vllm/engine/arg_utils.py": (
        "class AsyncEngineArgs:\n"
        "    add_cli_args = staticmethod(lambda parser: parser)\n"
        "    from_cli_args = staticmethod(lambda ns: ns)\n"),
    "vllm/utils/__init__.py": "",
    "vllm/utils/argparse_utils.py": "from argparse import ArgumentParser as FlexibleArgumentParser\n",
    "vllm/v1/__init__.py": "",
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/engine/async_llm.py": """
import asyncio, json, os
from types import SimpleNamespace


class AsyncLLM:
    @classmethod
    def from_engine_args(cls, args):
        return cls()

    async def pause_generation(self, **kw): pass
    async def resume_generation(self): pass
    def shutdown(self): pass

    async def add_request(self, rid, prompt, params, data_parallel_rank=None):
        with open(os.environ["PROMPT_IDS"], "a") as f:
            f.write(json.dumps(prompt["prompt_token_ids"]) + "\\n")
        if "DP_RANKS" in os.environ:
            with open(os.environ["DP_RANKS"], "a") as f:
                f.write(json.dumps([rid, data_parallel_rank]) + "\\n")
        q = asyncio.Queue()
        done = SimpleNamespace(token_ids=[1] * params.max_tokens)
        q.put_nowait(SimpleNamespace(finished=True, outputs=[done]))
        return q
""",
}


def test_every_run_is_given_the_models_vocabulary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict] = []

    def engine(mode: str, args, work, extra: dict, options: dict, *a, **kw) -> dict:
        seen.append(options)
        return {"engine_init_s": 3.0, "tokens": {"1": [[5]]}, "ember": {}}

    _published_bench(monkeypatch, tmp_path, engine, loads=1)
    assert {o["vocab"] for o in seen} == {128256}  # the Llama-3-8B shape's config


@pytest.mark.parametrize(("vocab", "highest"), [(128256, 64128), (None, 0)])
def test_the_engine_child_times_its_import_and_prompts_from_the_whole_vocabulary(
        vocab: int | None, highest: int, tmp_path: Path) -> None:
    """A rank masking token ids with another rank's vocabulary bounds changes tokens only for ids
    outside rank 0's shard, which ids below 30000 (rank 0's alone at TP=2) never are. The pins
    bench, which compares timings only, gives no vocabulary."""
    import os
    import subprocess
    import sys

    for name, text in FAKE_VLLM.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    out, ids = tmp_path / "out.json", tmp_path / "ids.jsonl"
    spec = {"engine_args": [], "out": str(out), "batch_sizes": [64], "max_tokens": 2,
            **({"vocab": vocab} if vocab else {})}
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PROMPT_IDS": str(ids),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root / "benchmarks"), str(root)])}
    subprocess.run([sys.executable, "-c", vp.CHILD, json.dumps(spec)], env=env, check=True, timeout=60)
    res = json.loads(out.read_text())
    assert 0 < res["import_s"] <= res["first_token_s"] and res["tokens"]["64"][0] == [1, 1]
    top = max(i for line in ids.read_text().splitlines() for i in json.loads(line))
    assert top >= highest if vocab else top < 30000  # rank 1's shard of a TP=2 Llama starts at 64128


def test_with_data_parallel_each_batch_runs_on_every_dp_rank_in_turn(tmp_path: Path) -> None:
    """A dense model's DP ranks are independent engines, and vLLM balances requests over them: a
    batch split by timing would change its steps' shapes. Each batch goes whole to each DP rank,
    and every rank's own tokens are kept."""
    import os
    import subprocess
    import sys

    for name, text in FAKE_VLLM.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    out, sent = tmp_path / "out.json", tmp_path / "dp.jsonl"
    spec = {"engine_args": [], "out": str(out), "batch_sizes": [1, 3], "max_tokens": 2, "data_parallel": 2}
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PROMPT_IDS": str(tmp_path / "ids.jsonl"), "DP_RANKS": str(sent),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root / "benchmarks"), str(root)])}
    subprocess.run([sys.executable, "-c", vp.CHILD, json.dumps(spec)], env=env, check=True, timeout=60)
    assert set(json.loads(out.read_text())["tokens"]) == {"1@dp0", "1@dp1", "3@dp0", "3@dp1"}
    calls = [json.loads(line) for line in sent.read_text().splitlines()][1:]  # after the first token
    assert [r for _, r in calls] == [0, 1, 0, 0, 0, 1, 1, 1]
    assert len({rid for rid, _ in calls}) == len(calls), "request ids stay unique across ranks"


def test_a_dense_data_parallel_bench_saves_one_gpus_archive_and_serves_it_data_parallel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[tuple[list[str], dict]] = []
    saves: list[dict] = []

    def engine(mode: str, args, work, extra: dict, options: dict, *a, **kw) -> dict:
        runs.append((list(args), options))
        return {"engine_init_s": 3.0, "tokens": {"1@dp0": [[5]], "1@dp1": [[5]]}, "ember": {}}

    monkeypatch.setattr(vp, "run_engine", engine)
    monkeypatch.setattr(vp, "run_save", lambda ident, *a: saves.append(ident.parallelism.model_dump()) or {
        "published": True, "save_job_s": 9.0})
    monkeypatch.setattr("ember_bench.vllm_report._device", lambda: "gpu")
    vp.bench_parallel("llama-3-8b", 2, 1, False, 2, work=tmp_path, out_dir=tmp_path / "out", batch_sizes=[1],
                      max_tokens=2, gpu_memory_utilization=0.4, timeout=9, tp1_save=False)
    assert saves == [{"tensor": 1, "expert": 1, "data": 1}]
    for args, options in runs:
        assert args[args.index("--data-parallel-size") + 1] == "2" and options["data_parallel"] == 2


def test_a_seeded_run_runs_on_a_copy_of_another_runs_cache_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, str] = {}

    def session(cmd, env, logf, timeout) -> int:
        seen.update(env)
        Path(env["VLLM_CACHE_ROOT"], "written-by-the-run").write_text("")
        Path(logf).write_text("died")
        return 1

    monkeypatch.setattr("ember_bench.vllm.run_session", session)
    save = tmp_path / "vllm-cache-save"
    (save / "torch_compile_cache").mkdir(parents=True)
    (save / "torch_compile_cache" / "code.py").write_text("# SAVE's")
    res = vp.run_engine("native", [], tmp_path, {}, {}, 9, name="native-save-code", seed=save)
    root = tmp_path / "vllm-cache-native-save-code"
    assert seen["VLLM_CACHE_ROOT"] == str(root) and seen["TRITON_HOME"] == str(root / "triton-home")
    assert (root / "torch_compile_cache" / "code.py").read_text() == "# SAVE's"
    assert not (save / "written-by-the-run").exists() and res["rc"] == 1  # SAVE's own root untouched


def _best_config(root: Path, name: str, **config: object) -> None:
    path = root / "torch_compile_cache" / "torch_aot_compile" / "h" / "inductor_cache" / "ab" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**config, "time_taken_ms": 3, "triton_cache_hash": "x"}))


def test_the_code_a_run_generated_is_compared_with_natives_whatever_cache_root_it_names(
        tmp_path: Path) -> None:
    native, load = tmp_path / "native", tmp_path / "load"

    def code(root: Path, name: str, text: str) -> None:
        path = root / "torch_compile_cache" / "torch_aot_compile" / "h" / "inductor_cache" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    for root in (native, load):  # the same wrapper; its comments name each run's own root
        code(root, f"ab/wrapper-{root.name}.py", f"# kernel path: {root}/inductor_cache/k0.py\ncall(k0)\n")
        # the same kernel, compiled with another ptxas (ember pins torch's)
        backend = "91D1D1166449" if root == native else "B01020984EF4"
        code(root, "cd/k0.py", f"def k0(): ...\nmeta = {{'backend_hash': '{backend}', 'x': 1}}\n")
    code(native, "cd/k1.py", "def k1(): ...\n")
    code(load, "ef/k9.py", "def k9(): ...\n")  # code native never generated
    (load / "torch_compile_cache" / "other.py").write_text("")  # not Inductor's
    runs = {"native": {"compiled_code": vp.compiled_code(native)},
            "load": {"compiled_code": vp.compiled_code(load)}}
    assert len(runs["load"]["compiled_code"]) == 3
    assert vp.code_not_in(runs["load"], runs["native"]) == 1
    code(load, "ab/other.py", "# kernel path: x\ncall(k1)\n")  # a wrapper that calls another kernel
    assert vp.code_not_in({"compiled_code": vp.compiled_code(load)}, runs["native"]) == 2
    assert vp.code_not_in(runs["native"], runs["native"]) == 0
    assert vp.code_not_in({"compiled_code": []}, runs["native"]) is None  # nothing to compare
    assert vp.triton_backends(native) == ["91D1D1166449"] and vp.triton_backends(load) == ["B01020984EF4"]


def test_autotune_choices_are_read_from_a_cache_root_and_compared_without_timings(tmp_path: Path) -> None:
    native, load = tmp_path / "native", tmp_path / "load"
    _best_config(native, "k1.best_config", XBLOCK=1, R0_BLOCK=2048, num_warps=16)
    _best_config(native, "k2.best_config", XBLOCK=64, num_warps=4)
    _best_config(load, "k1.best_config", XBLOCK=8, R0_BLOCK=512, num_warps=8)  # another reduction order
    _best_config(load, "k2.best_config", XBLOCK=128, num_warps=8)  # pointwise: the same results
    _best_config(load, "k3.best_config", XBLOCK=1, num_warps=1)  # native never launched it
    (load / "torch_compile_cache" / "broken.best_config").write_text("{not json")
    runs = {"native": {"autotune": vp.autotune_choices(native)},
            "load": {"autotune": vp.autotune_choices(load)}}
    assert runs["native"]["autotune"]["k1.best_config"] == {"XBLOCK": 1, "R0_BLOCK": 2048, "num_warps": 16}
    assert set(runs["load"]["autotune"]) == {"k1.best_config", "k2.best_config", "k3.best_config"}
    assert vp.autotune_differs(runs["load"], runs["native"]) == 1
    assert vp.autotune_differs(runs["native"], runs["native"]) == 0
    assert vp.autotune_choices(tmp_path / "missing") == {}


def test_a_fresh_run_starts_from_an_empty_cache_root_of_its_own(tmp_path: Path) -> None:
    stale = tmp_path / "vllm-cache-native-fresh" / "torch_compile_cache"
    stale.mkdir(parents=True)
    env = vp.child_env("native", [], tmp_path, {}, fresh=True)
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm-cache-native-fresh") and not stale.exists()
    assert env["TRITON_HOME"] == str(tmp_path / "vllm-cache-native-fresh" / "triton-home")  # not ~/.triton
    (tmp_path / "vllm-cache-native" / "kept").mkdir(parents=True)
    assert vp.child_env("native", [], tmp_path, {})["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm-cache-native")
    assert (tmp_path / "vllm-cache-native" / "kept").is_dir()  # a warm run keeps its cache


def test_a_save_that_published_nothing_gets_one_load_and_the_summary_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every LOAD without an archive refuses: one shows it (served natively), not `--loads` of them."""
    names: list[str] = []

    def engine(mode: str, *a, name: str = "", **kw) -> dict:
        names.append(name or mode)
        return {"engine_init_s": 5.0, "tokens": {"1": [[5]]}, "ember": {}}

    monkeypatch.setattr(vp, "run_engine", engine)
    saves: list[object] = []
    failed = {"published": False, "error": "proof failed", "save_job_s": 9.0}
    monkeypatch.setattr(vp, "run_save", lambda *a: saves.append(a) or failed)
    monkeypatch.setattr("ember_bench.vllm_report._device", lambda: "gpu")
    out = vp.bench_parallel("llama-3-8b", 2, 2, False, 1, work=tmp_path, out_dir=tmp_path / "out",
                            batch_sizes=[1], max_tokens=2, gpu_memory_utilization=0.4, timeout=9,
                            tp1_save=True, loads=10)
    summary = json.loads(out.read_text())["summary"]
    # no reference (nothing to restore) and no TP=1 SAVE to compare with
    assert names == ["native", "load", "native-again"] and len(saves) == 1
    assert summary["loads"] == 1 and summary["loads_restored_every_rank"] == 0
    assert summary["save_published"] is False and summary["save_error"] == "proof failed"


def test_the_shape_flags_give_vllms_expert_parallel_size_or_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[tuple] = []
    monkeypatch.setattr(vp, "bench_parallel", lambda m, layers, t, e, d, **kw: got.append((t, e, d)))
    vp.bench_shape("qwen3-moe", 2, 1, 2, 1)  # --ep 2 alone: attention data parallel
    vp.bench_shape("qwen3-moe", 2, 2, 2, 1)  # EP over TP=2
    assert got == [(1, True, 2), (2, True, 1)]
    with pytest.raises(typer.BadParameter, match="--ep 3 must be tensor x data = 2"):
        vp.bench_shape("qwen3-moe", 2, 2, 3, 1)


def test_the_triton_kernels_a_run_compiled_are_those_written_while_it_ran(tmp_path: Path) -> None:
    """A LOAD's cache root holds the archive's kernels with SAVE's times; only what the run
    compiled itself counts."""
    import os
    import time

    def kernel(where: Path, name: str, mtime: float | None = None) -> None:
        where.mkdir(parents=True)
        group = where / f"__grp__{name}.json"
        group.write_text("{}")
        (where / f"{name}.json").write_text("{}")
        if mtime is not None:
            os.utime(group, (mtime, mtime))

    since = time.time()
    kernel(tmp_path / "triton-home" / ".triton" / "cache" / "A1", "_sampler", since - 3600)  # the archive's
    kernel(tmp_path / "triton-home" / ".triton" / "cache" / "B2", "_prepare_inputs")  # compiled now
    kernel(tmp_path / "torch_compile_cache" / "x" / "inductor_cache" / "triton" / "0" / "C3", "triton_red_0")
    assert vp.triton_compiled_kernels(tmp_path, since) == [  # where each went: the home, or Inductor's own
        "torch_compile_cache/x/inductor_cache/triton/0/triton_red_0",
        "triton-home/.triton/cache/_prepare_inputs"]
    assert vp.triton_compiled_kernels(tmp_path / "missing", since) == []


def test_the_summary_names_what_saves_compiled_code_was_traced_with(tmp_path: Path) -> None:
    from ember.archive import bundle
    from ember.identity import ArchiveIdentity, CompatKey
    from ember.store import LocalStore
    from ember_testing.synthetic import synthetic_graphset, synthetic_images

    ident = ArchiveIdentity(model="m", engine="vllm", engine_version="0.26.0", capture_sizes=(1, 2))
    compat = CompatKey(gpu_name="NVIDIA H200", compute_capability="9.0", driver="580", cuda="13.0")
    bundle.write_archive(LocalStore(tmp_path / "store"), synthetic_graphset(graphs=2, nodes=20, groups=1),
                         ident, compat, kernel_images=synthetic_images(),
                         engine={"compiled_with": ["vocab-bounds"]})
    assert vp.archive_facts(tmp_path / "store", ident.hash())["compiled_with"] == ["vocab-bounds"]
    assert vp.archive_facts(tmp_path / "store", "0" * 64) == {}  # none published under that identity


def test_ab_cycles_the_loads_through_each_setting_and_gives_each_group_its_own_spreads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--loads 6 --ab A --ab B`: LOADs 0 and 3 run without, 1 and 4 with A, 2 and 5 with B; the
    summary keeps each group's engine init, canary, restore stage and vLLM's warm-up after it
    apart, and counts every LOAD's tokens."""
    from ember_bench import vllm as bench

    envs: dict[str, dict] = {}

    def engine(mode: str, args, work, extra, *a, name: str = "", **kw) -> dict:
        envs[name or mode] = dict(extra)
        b = extra.get("EMBER_LOAD_BACKGROUND") == "0"
        off = extra.get("EMBER_VLLM_CANARY") == "0"
        canary = 0.0 if off else 50.0 if b else 150.0
        report = {"stages": {"capture": {"how": "restored" if mode == "load" else "native",
                                         "seconds": 0.2 + canary / 1e3},
                             "verify": {"ok": True, "verify_ms": canary},
                             "worker.compile_or_warm_up_model": {"seconds": 1.5 if b else 1.2}}}
        init = 40.0 if mode == "native" else (12.0 if b else 11.0) + len(envs) / 100
        return {"engine_init_s": init, "tokens": {"1": [[5]]}, "ember": report}

    monkeypatch.setattr(vp, "run_engine", engine)
    monkeypatch.setattr(vp, "run_save", lambda *a: {"published": True, "save_job_s": 60.0})
    monkeypatch.setattr("ember_bench.vllm_report._device", lambda: "gpu")
    ab = ["EMBER_LOAD_BACKGROUND=0", "EMBER_VLLM_CANARY=0"]
    for bad in (["EMBER_LOAD_BACKGROUND"], [*ab, "X=1"]):  # no value; 4 groups need 4 LOADs or more
        with pytest.raises(typer.BadParameter):
            bench.bench_vllm(model="llama-3-8b", layers=2, work=tmp_path, out_dir=tmp_path / "out", loads=3,
                             ab=bad)
    bench.bench_vllm(model="llama-3-8b", layers=2, work=tmp_path, out_dir=tmp_path / "out", loads=6,
                     ab=ab, batch_sizes="1", max_tokens=2)
    assert [n for n, e in envs.items() if e.get("EMBER_LOAD_BACKGROUND") == "0"] == ["load-1", "load-4"]
    assert [n for n, e in envs.items() if e.get("EMBER_VLLM_CANARY") == "0"] == ["load-2", "load-5"]
    assert all("EMBER_VLLM_ARCHIVE" in envs[n] for n in ("load", "load-1", "load-2", "load-3"))
    summary = json.loads((tmp_path / "out" / "vllm-gpu-llama-3-8b-tp1.json").read_text())["summary"]
    assert summary["ab"] == ab and list(summary["ab_loads"]) == ["without", *ab]
    a, b, off = (summary["ab_loads"][k] for k in ("without", *ab))
    assert a["loads"] == b["loads"] == off["loads"] == 2
    assert a["verify_ms_loads"]["median"] == 150.0 and b["verify_ms_loads"]["median"] == 50.0
    assert off["verify_ms_loads"]["max"] == 0.0
    assert a["compile_or_warm_up_model_s"]["max"] == 1.2 and b["compile_or_warm_up_model_s"]["min"] == 1.5
    assert a["after_capture_s"]["median"] == pytest.approx(0.85) and off["after_capture_s"]["min"] == 1.0
    assert a["engine_init_s_loads"]["max"] < 12.0 <= b["engine_init_s_loads"]["min"]
    assert summary["loads"] == 6 and summary["wrong_loads"] == 0


def test_a_native_run_that_serves_nothing_stops_the_bench_with_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Too little memory for native's KV cache: SAVE and every LOAD would fail the same way (and
    spend the GPU's time), and there would be no tokens to judge them by. The bench stops after
    native and says why."""
    names: list[str] = []
    tail = ("[rank0]: ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` | [rank0]:[W1202] Warning: destroy_process_group() was not called")

    def engine(mode: str, *a, name: str = "", **kw) -> dict:
        names.append(name or mode)
        return {"rc": 1, "log_tail": tail}

    monkeypatch.setattr(vp, "run_engine", engine)
    monkeypatch.setattr(vp, "run_save", lambda *a: pytest.fail("SAVE ran after native failed"))
    monkeypatch.setattr("ember_bench.vllm_report._device", lambda: "gpu")
    with pytest.raises(typer.Exit):
        vp.bench_parallel("qwen3-moe", 0, 1, False, 1, work=tmp_path, out_dir=tmp_path / "out",
                          batch_sizes=[1], max_tokens=2, gpu_memory_utilization=0.4, timeout=9, loads=6)
    assert names == ["native"]
    (out,) = (tmp_path / "out").iterdir()
    summary = json.loads(out.read_text())["summary"]
    assert summary["native_error"].startswith("ValueError: No available memory for the cache blocks.")
    assert vp.failure({"rc": 0, "tokens": {"1": [[5]]}}) == ""
    assert vp.failure({"rc": 0, "tokens": {}}) == "exit status 0, no tokens"


def test_a_load_that_serves_nothing_is_wrong_and_said_to_have_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def engine(mode: str, *a, name: str = "", **kw) -> dict:
        if name == "load-1":
            return {"rc": 1, "log_tail": "RuntimeError: CUDA error: an illegal memory access"}
        return {"rc": 0, "engine_init_s": 5.0, "tokens": {"1": [[5]]}, "ember": {}}

    summary = _published_bench(monkeypatch, tmp_path, engine, loads=3)
    assert summary["wrong_loads"] == 1 and summary["failed_loads"] == 1 and not summary["loads_agree"]
