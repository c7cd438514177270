"""CPU: which GPU a vLLM worker of a multi-GPU LOAD is narrowed to (`ember.engines.vllm.devices`),
and the refusal of a rank whose device index is not SAVE's (Inductor writes the index into the
compiled code every rank runs)."""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest

from ember.engines.vllm import devices


def _pc(backend: str = "mp", tp: int = 2, pp: int = 1, dp_local: int | None = None, dp_index: int = 0,
        nnodes: int = 1, dp_backend: str = "mp") -> Any:
    return SimpleNamespace(distributed_executor_backend=backend, data_parallel_backend=dp_backend,
                           nnodes_within_dp=nnodes, data_parallel_rank_local=dp_local,
                           data_parallel_index=dp_index, tensor_parallel_size=tp, pipeline_parallel_size=pp)


@pytest.mark.parametrize("local_rank, pc, want", [
    (1, _pc(), 1),                                    # TP=2, one engine: rank r on GPU r
    (0, _pc(tp=1, dp_local=1), 1),                    # DP=2 of TP=1 engines: DP rank 1 on GPU 1
    (1, _pc(tp=2, dp_local=1), 3),                    # DP=2 x TP=2: DP rank 1's block starts at 2
    (1, _pc(tp=2, dp_index=1), 3),                    # no local DP rank: the DP index
    (1, _pc(tp=2, pp=2, dp_local=1), 5),              # the block is TP x PP wide
    (1, _pc(backend="ray", dp_local=1), 1),           # Ray places its workers itself
    (1, _pc(dp_local=1, nnodes=2), 1),                # a DP rank over several nodes
])
def test_a_worker_is_narrowed_to_the_gpu_vllm_would_give_it(local_rank: int, pc: Any, want: int) -> None:
    assert devices.node_index(local_rank, pc) == want


def test_the_visible_gpus_are_the_environments_or_every_gpu() -> None:
    assert devices.visible({"CUDA_VISIBLE_DEVICES": "2, 3"}, lambda: 8) == ["2", "3"]
    assert devices.visible({"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"}, lambda: 8) == ["GPU-a1", "GPU-b2"]
    assert devices.visible({}, lambda: 2) == ["0", "1"]
    assert devices.visible({"CUDA_VISIBLE_DEVICES": " "}, lambda: 1) == ["0"]


def test_a_rank_on_another_device_index_than_saves_is_refused() -> None:
    assert devices.device_refusal(0, 0) == ""
    why = devices.device_refusal(0, 1)
    assert "device index 0" in why and "cuda:1" in why


@pytest.fixture
def vllm_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand-ins for vLLM's platform: logical id i is the i-th entry of CUDA_VISIBLE_DEVICES."""

    def physical(i: int) -> int:
        entry = os.environ["CUDA_VISIBLE_DEVICES"].split(",")[i]
        return int(entry.removeprefix("GPU-")) if entry.startswith("GPU-") else int(entry)

    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(device_id_to_physical_device_id=physical)  # type: ignore[attr-defined]
    cuda = types.ModuleType("vllm.platforms.cuda")
    cuda._cuda_device_count_stateless = lambda visible=None: 8  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", sys.modules.get("vllm") or types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setitem(sys.modules, "vllm.platforms.cuda", cuda)
    monkeypatch.setattr(devices, "driver_initialized", lambda: False)


def _worker(local_rank: int, **pc: Any) -> Any:
    return SimpleNamespace(local_rank=local_rank, parallel_config=_pc(**pc) if pc else _pc())


def test_each_worker_sees_only_the_gpu_vllm_gives_it(vllm_platform: None, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    w = _worker(1, tp=1, dp_local=2)  # DP rank 2 of TP=1 engines: the node's third GPU
    w.parallel_config.assigned_physical_gpu_ids = None
    done = devices.one_gpu(w)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7" and "GPU 3 of 4" in done
    # vLLM maps the worker's logical GPU through this to the one it now sees as cuda:0
    assert w.parallel_config.assigned_physical_gpu_ids == [4, 5, 6, 7]


@pytest.mark.parametrize("why, setup", [
    ("one GPU", lambda w, mp: mp.setenv("CUDA_VISIBLE_DEVICES", "3")),
    ("ray", lambda w, mp: setattr(w.parallel_config, "distributed_executor_backend", "ray")),
    ("a user's map", lambda w, mp: setattr(w.parallel_config, "assigned_physical_gpu_ids", [1, 0])),
    ("CUDA already up", lambda w, mp: mp.setattr(devices, "driver_initialized", lambda: True)),
])
def test_a_worker_is_left_as_vllm_sets_it_where_narrowing_cannot_hold(
        vllm_platform: None, monkeypatch, why: str, setup: Any) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    w = _worker(1)
    w.parallel_config.assigned_physical_gpu_ids = None
    setup(w, monkeypatch)
    before = dict(vars(w.parallel_config))
    visible = os.environ["CUDA_VISIBLE_DEVICES"]
    done = devices.one_gpu(w)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == visible, why
    assert vars(w.parallel_config) == before and (done == "" or done.startswith("left as vLLM sets it")), why


def test_vllms_set_device_makes_the_device_current_without_allocating(monkeypatch) -> None:
    """vLLM's async-output thread calls `set_device` (torch.zeros(1) inside) while the main thread
    allocates: under ember it binds the device through the driver instead, on every platform class."""
    from ember.engines.vllm import plugin

    calls: list[Any] = []

    class CudaPlatformBase:
        @classmethod
        def set_device(cls, device: Any) -> None:
            calls.append(("vllm's, with its allocation", device))

    class NvmlCudaPlatform(CudaPlatformBase):
        pass

    cuda = types.ModuleType("vllm.platforms.cuda")
    cuda.CudaPlatformBase = CudaPlatformBase  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.platforms"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.platforms.cuda", cuda)
    monkeypatch.setattr(sys.modules["vllm.platforms"], "cuda", cuda, raising=False)
    monkeypatch.setattr(devices, "set_device_eagerly", lambda device: calls.append(("ember's", device)))

    NvmlCudaPlatform.set_device("cuda:0")
    plugin._set_device_without_allocating()
    NvmlCudaPlatform.set_device("cuda:1")
    assert calls == [("vllm's, with its allocation", "cuda:0"), ("ember's", "cuda:1")]


def test_the_set_device_patch_is_a_checked_touch_point() -> None:
    from ember.engines.vllm.versions import TOUCH_POINTS

    assert ("vllm.platforms.cuda", "CudaPlatformBase.set_device") in {(m, p) for m, p, *_ in TOUCH_POINTS}
