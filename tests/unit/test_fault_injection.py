"""The injected kernel-argument fault (`ember.runtime.faults`) changes float scalars and halves one
count: a pointer moved, or a size grown, could make a kernel touch memory it does not own."""

from __future__ import annotations

import numpy as np

from ember.runtime import faults


def _arguments(*values: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """An argument pointer array over numpy buffers (as prepare_table's arena points into a pool)."""
    ptrs = np.array([v.ctypes.data for v in values], dtype=np.uint64)
    return ptrs, list(values)


def test_every_float_scalar_changes_in_a_new_buffer(caplog) -> None:
    size, eps, alpha = np.array([4096], np.int32), np.array([1e-6], np.float32), np.array([1.0], np.float64)
    ptrs, _keep = _arguments(size, np.array([0x7F00_1234_5000], np.uint64), eps, alpha)
    before = ptrs.copy()
    bufs = faults.corrupt_arguments(ptrs, [(0, (4, 8)), (2, (4, 8))], ["k0", "k1"], graph="(1, 0)")
    assert [b.ctypes.data for b in bufs] == [int(ptrs[2]), int(ptrs[3]), int(ptrs[0])]
    assert bufs[0].view(np.float32)[0] == np.float32(1e-6) * 2 + 1
    assert bufs[1].view(np.float64)[0] != 1.0  # a double's high word reads as a float (1.875)
    assert bufs[2].view(np.int32)[0] == 2048  # k1 has no count: k0's is halved
    assert ptrs[1] == before[1]  # the pointer never
    assert eps[0] == np.float32(1e-6) and size[0] == 4096  # the archive's bytes are not written
    assert "fault: graph (1, 0): 3 kernel argument(s), " in caplog.text  # which graph: is it launched?
    assert "k1: argument 0 word 0" in caplog.text
    assert "k0: argument 0: count 4096 -> 2048" in caplog.text  # kernels named


def test_one_count_is_halved_the_last_kernels_last_and_no_pointer_or_flag_changes() -> None:
    ints = [np.array([v], np.int32) for v in (0, 1, 15, 64, 4096, 1 << 20, 1 << 24)]
    ptrs, _keep = _arguments(*ints, np.array([0x7F00_1234_5000], np.uint64))
    before = ptrs.copy()
    (buf,) = faults.corrupt_arguments(ptrs, [(0, (4, 4, 4, 4)), (4, (4, 4, 4, 8))])
    assert buf.view(np.int32)[0] == 1 << 19 and ptrs[5] == buf.ctypes.data  # node 1's last count
    assert (np.delete(ptrs, 5) == np.delete(before, 5)).all()
    flags_only = [np.array([v], np.int32) for v in (0, 1, 2, 15, 1 << 24)]
    ptrs, _keep = _arguments(*flags_only)
    assert faults.corrupt_arguments(ptrs, [(0, (4, 4, 4, 4, 4))]) == []  # nothing to corrupt safely


def test_the_fault_is_off_unless_named(monkeypatch) -> None:
    monkeypatch.delenv("EMBER_FAULT", raising=False)
    assert not faults.active("kernel-arg")
    monkeypatch.setenv("EMBER_FAULT", "stale-update,kernel-arg")
    assert faults.active("kernel-arg") and not faults.active("own-exec")


def test_a_functor_of_two_floats_changes_but_a_pointer_never() -> None:
    pointer = np.array([0x7F00_3F80_0000], np.uint64)  # its low word reads as 1.0f
    functor = np.array([1.0, 1e-5], np.float32)  # (alpha, b): an 8-byte argument
    ptrs, _keep = _arguments(pointer, functor)
    (buf,) = faults.corrupt_arguments(ptrs, [(0, (8, 8))])
    assert ptrs[0] == pointer.ctypes.data
    assert list(buf.view(np.float32)) == [3.0, np.float32(1e-5) * 2 + 1]


def test_in_inductors_graphs_every_pointwise_kernels_count_is_halved(caplog) -> None:
    """vLLM's graphs: the last kernel's count alone covered elements nothing read (the fault was
    inert), so every Inductor pointwise kernel's `xnumel` is halved; other kernels keep theirs."""
    counts = [np.array([v], np.int32) for v in (4096, 8192, 2048, 1 << 20)]
    ptrs, _keep = _arguments(np.array([0x7F00_1234_5000], np.uint64), *counts)
    names = ["triton_poi_fused_0", "triton_red_fused_1", "triton_poi_fused_mul_silu_2", "sm90_xmma_gemm"]
    nodes = [(0, (8, 4)), (2, (4,)), (3, (4,)), (4, (4,))]
    bufs = faults.corrupt_arguments(ptrs, nodes, names)
    assert [int(b.view(np.int32)[0]) for b in bufs] == [2048, 1024]
    assert [int(ptrs[i]) for i in (1, 3)] == [b.ctypes.data for b in bufs]  # the two pointwise counts
    assert int(ptrs[2]) == counts[1].ctypes.data and int(ptrs[4]) == counts[3].ctypes.data  # not theirs
    assert "triton_poi_fused_mul_silu_2: argument 0: count 2048 -> 1024" in caplog.text
    plain = [np.array([v], np.int32) for v in (4096, 8192)]
    ptrs, _keep = _arguments(*plain)
    (buf,) = faults.corrupt_arguments(ptrs, [(0, (4,)), (1, (4,))], ["triton_red_fused_0", "gemm"])
    assert int(buf.view(np.int32)[0]) == 4096 and int(ptrs[1]) == buf.ctypes.data  # no pointwise: the last


def test_an_own_exec_fault_leaves_the_keys_graph_to_the_templates(monkeypatch) -> None:
    """`own-exec` builds the own execs from corrupted arguments. The graph built beside one is the
    key's graph otherwise (the templates' exec updates load it): under the fault it is not kept,
    so the templates compute the right thing and only the own-exec path differs (a canary that
    builds the own execs first refused on the templates' path instead, h200-20261203)."""
    import threading
    from types import SimpleNamespace

    from ember.runtime.graphs import templates

    destroyed: list[str] = []
    monkeypatch.setattr(templates, "cu", SimpleNamespace(cuGraphDestroy=destroyed.append))
    for fault, kept in ((False, {3: "built"}), (True, {})):
        lib = SimpleNamespace(driver_lock=threading.Lock(), _graphs={}, own_fault=fault)
        templates.GraphLibrary.keep_graph(lib, 3, "built")  # type: ignore[arg-type]
        assert lib._graphs == kept
    assert destroyed == ["built"]
