"""CPU: the plugin's record of a vLLM worker's start-up stages, and the allocation-trace diagnostic.
On N ranks a worker whose stage raises leaves its peers waiting in a collective for ever (vLLM's
executor waits on every rank's reply): the raise must be in that rank's report."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from ember.engines.vllm import memtrace, plugin
from ember.engines.vllm import report as reports


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Any:
    """A stand-in `vllm.v1.worker.gpu_worker` whose Worker fails `determine_available_memory`."""

    class Worker:
        def init_device(self) -> None: ...
        def load_model(self) -> None: ...
        def determine_available_memory(self) -> int:
            raise RuntimeError("expected all tensors to be on the same device")
        def initialize_from_config(self, *a: Any) -> None: ...
        def compile_or_warm_up_model(self) -> float:
            return 1.0

    module = types.ModuleType("vllm.v1.worker.gpu_worker")
    module.Worker = Worker  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.v1", "vllm.v1.worker"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_worker", module)
    monkeypatch.setattr(sys.modules["vllm.v1.worker"], "gpu_worker", module, raising=False)
    monkeypatch.setattr(plugin, "STATE", plugin._State())
    monkeypatch.setenv("EMBER_VLLM_REPORT", str(tmp_path / "vllm-report.json"))
    monkeypatch.delenv(memtrace.ENV, raising=False)
    plugin._time_worker_stages()
    return Worker()


def test_a_stage_that_raises_is_in_the_report_and_still_raises(worker: Any, tmp_path) -> None:
    worker.load_model()
    with pytest.raises(RuntimeError, match="same device"):
        worker.determine_available_memory()
    stages = reports.read(tmp_path / "vllm-report.json")["stages"]
    assert "error" not in stages["worker.load_model"]
    failed = stages["worker.determine_available_memory"]
    assert failed["error"] == "RuntimeError: expected all tensors to be on the same device"
    assert "bytes" not in failed


def test_a_stage_that_returns_is_timed_without_an_error(worker: Any, tmp_path) -> None:
    assert worker.compile_or_warm_up_model() == 1.0
    stage = reports.read(tmp_path / "vllm-report.json")["stages"]["worker.compile_or_warm_up_model"]
    assert "error" not in stage and stage["seconds"] >= 0


class _Unpublished:
    """SAVE's outcome as `save(publish_later=True)` leaves it: published by `publish_now()`."""

    def __init__(self, fails: bool = False) -> None:
        self.calls, self.fails, self.published = 0, fails, False
        self.publish_now: Any = self._publish

    def _publish(self) -> None:
        self.calls += 1
        self.publish_now = None
        if self.fails:
            raise OSError("store unreachable")
        self.published = True

    def summary(self) -> dict[str, Any]:
        return {"published": self.published, "graphs": 3}


def test_save_publishes_once_after_the_warm_up_that_compiles_vllms_own_kernels(worker: Any, tmp_path) -> None:
    assert plugin.STATE.warm_up_timed  # so the SAVE defers (plugin._save)
    outcome = _Unpublished()
    plugin.STATE.unpublished = outcome
    plugin.report("save", published=False, graphs=3, seconds=1.5)
    worker.compile_or_warm_up_model()
    worker.compile_or_warm_up_model()  # a second warm-up publishes nothing more
    save = reports.read(tmp_path / "vllm-report.json")["stages"]["save"]
    assert outcome.calls == 1 and save["published"] is True and save["seconds"] == 1.5
    assert save["publish_after_warm_up_s"] >= 0 and plugin.STATE.unpublished is None


def test_a_failed_warm_up_or_store_publishes_nothing_and_says_why(worker: Any, tmp_path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    outcome = _Unpublished()
    plugin.STATE.unpublished = outcome
    def fails(self: Any) -> float:
        raise RuntimeError("warm-up failed")

    monkeypatch.setattr(type(worker), "compile_or_warm_up_model", fails)
    plugin._time_worker_stages()
    with pytest.raises(RuntimeError):
        worker.compile_or_warm_up_model()
    assert outcome.calls == 0  # the engine never served: its archive is not published
    failing = _Unpublished(fails=True)
    plugin.STATE.unpublished = failing
    plugin.publish_saved()
    stages = reports.read(tmp_path / "vllm-report.json")["stages"]
    assert failing.calls == 1 and "save" not in stages
    assert stages["save_refused"]["reason"] == "publishing: OSError: store unreachable"


SNAPSHOT = {
    "segments": [
        {"device": 1, "address": 0x6000, "total_size": 2 << 20, "segment_type": "small",
         "blocks": [{"size": 512, "requested_size": 4, "state": "active_allocated",
                     "frames": [{"filename": "/x/site-packages/torch/cuda/__init__.py", "line": 1,
                                 "name": "f"},
                                {"filename": "/x/site-packages/vllm/distributed/pynccl.py", "line": 9,
                                 "name": "__init__"}]},
                    {"size": 2 << 20, "state": "inactive", "frames": []}]},
        {"device": 0, "address": 0x9000, "total_size": 20 << 20, "segment_type": "large", "blocks": []},
    ],
    "device_traces": [
        [{"action": "segment_alloc", "size": 1, "addr": 1, "frames": []}],
        [{"action": "segment_alloc", "size": 2 << 20, "addr": 0x6000,
          "frames": [{"filename": "/x/site-packages/vllm/v1/worker/gpu_model_runner.py", "line": 5,
                      "name": "__init__"}]},
         {"action": "free_requested", "size": 512, "addr": 0x6000, "frames": []},
         {"action": "alloc", "size": 512, "addr": 0x6000,
          "frames": [{"filename": "??", "line": 0, "name": "?"}]}],
    ],
}


def test_the_trace_keeps_this_devices_segments_live_blocks_and_allocations_with_their_callers() -> None:
    got = memtrace.summarize(SNAPSHOT, device=1)
    assert got["segments"] == [{"address": 0x6000, "size": 2 << 20, "pool": "small",
                                "live": [{"size": 4, "frames": ["vllm/distributed/pynccl.py:9 __init__"]}]}]
    assert [(e["i"], e["action"]) for e in got["trace"]] == [(0, "segment_alloc"), (2, "alloc")]
    assert got["trace"][0]["frames"] == ["vllm/v1/worker/gpu_model_runner.py:5 __init__"]
    assert got["trace"][1]["frames"] == []  # frames without a file say nothing
    assert memtrace.summarize(SNAPSHOT, device=3) == {"segments": [], "trace": []}


def test_tracing_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv(memtrace.ENV, raising=False)
    assert memtrace.folder() is None and memtrace.dump("load", 0, "armed") is None
    monkeypatch.setenv(memtrace.ENV, str(tmp_path))
    assert memtrace.folder() == tmp_path


def _seg(size: int, where: str) -> dict[str, Any]:
    return {"action": "segment_alloc", "size": size, "frames": [where]}


def test_two_dumps_are_compared_up_to_their_first_differing_segment() -> None:
    saved = {"trace": [_seg(2 << 20, "runner.py:1"), {"action": "alloc", "size": 8, "frames": []},
                       _seg(20 << 20, "runner.py:9"), _seg(2 << 20, "model.py:3")]}
    loaded = {"trace": [_seg(2 << 20, "runner.py:1"), _seg(2 << 20, "restore.py:7"),
                        _seg(20 << 20, "runner.py:9")]}
    got = memtrace.compare(saved, loaded, context=1)
    assert got[0] == f"segment allocation #1 differs: SAVE {20 << 20} B, LOAD {2 << 20} B"
    assert f"> #1 LOAD {2 << 20:>12} restore.py:7" in got and f"> #1 SAVE {20 << 20:>12} runner.py:9" in got
    assert any(line.startswith("  #0 SAVE") for line in got)  # the context before it
    assert memtrace.compare(saved, {"trace": saved["trace"][:2]}) == []  # a prefix: nothing differs yet


def test_a_stage_kept_unflushed_reaches_the_file_with_the_next_one(worker: Any, tmp_path) -> None:
    """A worker's note before its rank is known waits for the worker's next write (which goes to
    its rank's file), instead of rewriting the file its peers and the engine core share."""
    path = tmp_path / "vllm-report.json"
    plugin.report("one_gpu", flush=False, done="CUDA_VISIBLE_DEVICES=1")
    assert not path.exists()
    plugin.report("armed", mode="load")
    stages = reports.read(path)["stages"]
    assert stages["one_gpu"]["done"] == "CUDA_VISIBLE_DEVICES=1" and stages["armed"]["mode"] == "load"
