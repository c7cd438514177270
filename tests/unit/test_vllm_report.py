"""The vLLM plugin's stage report: processes that run one after another share the file, the GPU
workers of a parallel shape write one file each, and a pod counts as restored only when every
rank of its world restored."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ember.engines.vllm import report


def _capture(how: str) -> dict:
    return {"stages": {"capture": {"how": how}}}


def test_processes_in_turn_add_their_stages_to_one_file(tmp_path: Path) -> None:
    path = tmp_path / "vllm-report.json"
    report.write(path, {"stages": {"compile_cache": {"files": 3}}, "model": "m"}, None)
    report.write(path, _capture("restored"), None)
    got = json.loads(path.read_text())
    assert set(got["stages"]) == {"compile_cache", "capture"} and got["model"] == "m"
    assert report.ranks_restored(report.read(path))


def test_each_rank_writes_its_own_file_and_every_rank_must_restore(tmp_path: Path) -> None:
    path = tmp_path / "vllm-report.json"
    report.write(path, {"stages": {"compile_cache": {"files": 3}}}, None)  # the front end
    report.write(path, _capture("restored"), (0, 2))
    assert not report.ranks_restored(report.read(path)), "rank 1 has not reported: not restored"
    report.write(path, _capture("native-after-refusal"), (1, 2))
    got = report.read(path)
    assert set(got["ranks"]) == {"0", "1"} and got["ranks"]["1"]["world"] == 2
    assert "capture" not in got["stages"], "rank files never write into the shared file"
    assert not report.ranks_restored(got), "one rank captured natively: the pod is not restored"
    report.write(path, _capture("restored"), (1, 2))
    assert report.ranks_restored(report.read(path))


def test_a_single_gpu_report_without_a_restored_capture_is_not_restored(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    assert not report.ranks_restored(report.read(path)), "no report at all"
    report.write(path, _capture("native"), None)
    assert not report.ranks_restored(report.read(path))


def test_clear_removes_a_previous_starts_report_and_rank_files(tmp_path: Path) -> None:
    path = tmp_path / "vllm-report.json"
    report.write(path, _capture("restored"), None)
    report.write(path, _capture("restored"), (1, 4))
    (tmp_path / "other.json").write_text("{}")
    report.clear(path)
    assert [p.name for p in tmp_path.iterdir()] == ["other.json"]
    assert report.read(path) == {}


def test_outside_a_distributed_world_there_is_no_rank() -> None:
    assert report.worker_rank() is None  # torch not imported, or no process group


def _torch(rank: int, world: int) -> SimpleNamespace:
    dist = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                           get_rank=lambda: rank, get_world_size=lambda: world)
    return SimpleNamespace(distributed=dist)


def test_a_dense_models_data_parallel_replicas_are_ranks_of_the_pod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM gives each DP replica of a dense model DP 1 and a world of its own: its workers are
    numbered after the earlier replicas' (data_parallel_index), so each writes its own file and
    the pod is restored only when every replica's every rank is."""
    env = {report.REPLICAS_ENV: "2"}
    assert report.replica(SimpleNamespace(data_parallel_size=1, data_parallel_index=1), env) == (1, 2)
    assert report.replica(SimpleNamespace(data_parallel_size=2, data_parallel_index=1), env) is None, "MoE"
    assert report.replica(SimpleNamespace(data_parallel_size=1, data_parallel_index=1), {}) is None
    assert report.replica(SimpleNamespace(data_parallel_size=1, data_parallel_index=3), env) is None
    assert report.replica(SimpleNamespace(data_parallel_size=1), {report.REPLICAS_ENV: "two"}) is None
    assert report.replica(None, env) is None, "a worker without a parallel config"
    monkeypatch.setitem(sys.modules, "torch", _torch(0, 1))
    assert report.worker_rank() is None and report.worker_rank((1, 2)) == (1, 2)
    monkeypatch.setitem(sys.modules, "torch", _torch(1, 2))  # TP 2 in each of 2 replicas
    assert report.worker_rank((1, 2)) == (3, 4) and report.worker_rank() == (1, 2)
    path = tmp_path / "vllm-report.json"
    report.write(path, _capture("restored"), (0, 2))
    assert not report.ranks_restored(report.read(path)), "replica 1 has not reported"
    report.write(path, _capture("restored"), (1, 2))
    assert report.ranks_restored(report.read(path))


def _stages(**stages: dict) -> dict:
    return {"stages": stages}


def test_a_pod_not_restored_on_every_rank_says_which_rank_refused_and_why(tmp_path: Path) -> None:
    from ember.serving.vllm import _not_restored

    path = tmp_path / "vllm-report.json"
    report.write(path, _stages(capture={"how": "native-after-refusal"},
                               load_refused={"reason": "load: a peer rank refused the archive"}), (0, 2))
    report.write(path, _stages(refused={"reason": "load: group tp:0 has 4 ranks here, 2 in the archive"},
                               capture={"how": "native"}), (1, 2))
    got = report.read(path)
    each = [one["stages"] for one in got["ranks"].values()]
    why = _not_restored(got, each)
    assert why.startswith("rank 0: load: a peer rank refused"), why
    assert "(restored on 0 of 2 ranks)" in why


def test_a_rank_that_never_reported_is_named(tmp_path: Path) -> None:
    from ember.serving.vllm import _not_restored

    path = tmp_path / "vllm-report.json"
    report.write(path, _stages(capture={"how": "restored"}), (0, 2))
    got = report.read(path)
    why = _not_restored(got, [got["ranks"]["0"]["stages"]])
    assert why == "vllm-report-missing: 1 of 2 ranks reported (restored on [0])", why


def test_the_sidecar_hears_ok_only_when_every_rank_restored(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from ember.serving import vllm as serving

    heard: list[tuple] = []
    monkeypatch.setattr(serving.handoff, "report", lambda *a, **k: heard.append((a, k)))
    path = tmp_path / "vllm-report.json"
    report.write(path, {"stages": {"load": {"seconds": 1.5, "graphs": 9}, "capture": {"how": "restored"}}},
                 (0, 2))
    report.write(path, {"stages": {"load": {"seconds": 2.0, "graphs": 9}, "capture": {"how": "restored"}}},
                 (1, 2))
    vp = SimpleNamespace(result=SimpleNamespace(archive_dir=tmp_path), handoff_dir=tmp_path,
                         plugin_report=lambda: report.read(path))
    serving.report_load(vp)  # type: ignore[arg-type]
    (args, kw), = heard
    assert args[:3] == ("load", 2.0, "ok") and kw["ranks"] == 2 and kw["graphs"] == 9
    heard.clear()
    refused = {"capture": {"how": "native-after-refusal"},
               "load_refused": {"reason": "load: a peer rank refused the archive"}}
    report.write(path, {"stages": refused}, (1, 2))
    serving.report_load(vp)  # type: ignore[arg-type]
    (args, kw), = heard
    assert args[2] == "fallback" and args[3].startswith("rank 1: load: a peer rank refused"), args
