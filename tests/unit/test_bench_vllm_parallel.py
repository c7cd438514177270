"""CPU: `ember bench vllm --tp/--ep/--dp` names its shapes, builds the deployment's identity and
reads each rank's figures from the plugin's report files."""

from __future__ import annotations

from pathlib import Path

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
