"""The vLLM plugin's stage report: processes that run one after another share the file, the GPU
workers of a parallel shape write one file each, and a pod counts as restored only when every
rank of its world restored."""

from __future__ import annotations

import json
from pathlib import Path

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
