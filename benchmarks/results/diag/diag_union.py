"""Can one exec serve chains of different topologies, with the nodes a chain lacks disabled?

A union template is a chain holding every node of several chains (a shortest common
supersequence); a key runs on it with the nodes it does not have disabled
(`cuGraphNodeSetEnabled`). This checks, on a real GPU, what that relies on:

- a disabled kernel or memset node does nothing and its neighbours stay ordered (each kernel
  makes out = out * 3 + v, so a skipped, extra or reordered node changes the result);
- whether `cuGraphExecUpdate` keeps or resets the enabled state it is given;
- a disabled node with a cluster dimension is fine;
- what a chain of N nodes costs to instantiate and to run, with and without disabled nodes,
  and what one `cuGraphNodeSetEnabled` costs;
- which memset shapes a disabled memset node really skips: on an H200 (driver 580.159) one of
  element size 1 and width 4 inside a Llama graph still wrote (diag_union_members.py), while
  element size 4, width 1 here was inert.

    python benchmarks/results/diag/diag_union.py --out DIR      (needs nvcc and an sm_90 GPU)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path
from typing import Any

from cuda.bindings import driver as cu
from diag_cluster_update import kernel  # run from benchmarks/results/diag: its siblings import

SRC = r"""
extern "C" __global__ void step(unsigned* out, unsigned v) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = out[0] * 3u + v;
}
"""


def ok(res: Any, what: str) -> Any:
    res = res if isinstance(res, tuple) else (res,)
    if int(res[0]) != 0:
        raise RuntimeError(f"{what}: {res[0]}")
    return res[1] if len(res) == 2 else (res[1:] if len(res) > 2 else None)


class Chain:
    """A chain graph: ("k", v[, cluster]) kernel nodes, ("m", value[, element size, width]) memsets
    of out (default: one 4-byte element)."""

    def __init__(self, func: Any, out: int, spec: list[tuple[Any, ...]], keep: list[Any]) -> None:
        self.graph = ok(cu.cuGraphCreate(0), "cuGraphCreate")
        self.nodes: list[Any] = []
        prev: list[Any] = []
        for item in spec:
            if item[0] == "k":
                a0, a1 = ctypes.c_uint64(out), ctypes.c_uint32(item[1])
                argv = (ctypes.c_void_p * 2)(ctypes.addressof(a0), ctypes.addressof(a1))
                keep += [a0, a1, argv]
                p = cu.CUDA_KERNEL_NODE_PARAMS()
                p.func = func
                p.gridDimX, p.gridDimY, p.gridDimZ = item[2] if len(item) > 2 else 1, 1, 1  # whole clusters
                p.blockDimX, p.blockDimY, p.blockDimZ = 32, 1, 1
                p.kernelParams = ctypes.addressof(argv)
                node = ok(cu.cuGraphAddKernelNode(self.graph, prev, len(prev), p), "add kernel")
                if len(item) > 2:
                    v = cu.CUkernelNodeAttrValue()
                    v.clusterDim.x, v.clusterDim.y, v.clusterDim.z = item[2], 1, 1
                    attr = cu.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                    ok(cu.cuGraphKernelNodeSetAttribute(node, attr, v), "cluster attr")
            else:
                m = cu.CUDA_MEMSET_NODE_PARAMS()
                size, width = item[2:4] if len(item) > 2 else (4, 1)
                m.dst, m.pitch, m.value, m.elementSize, m.width, m.height = out, 0, item[1], size, width, 1
                keep.append(m)
                ctx = ok(cu.cuCtxGetCurrent(), "ctx")
                node = ok(cu.cuGraphAddMemsetNode(self.graph, prev, len(prev), m, ctx), "add memset")
            self.nodes.append(node)
            prev = [node]


def expect(spec: list[tuple[Any, ...]], on: list[bool]) -> int:
    x = 7
    for item, enabled in zip(spec, on, strict=True):
        if not enabled:
            continue
        x = (x * 3 + item[1]) & 0xFFFFFFFF if item[0] == "k" else item[1]
    return x


def run(ex: Any, stream: Any, out: int) -> int:
    ok(cu.cuMemsetD32Async(out, 7, 1, stream), "memset")
    ok(cu.cuGraphLaunch(ex, stream), "cuGraphLaunch")
    ok(cu.cuStreamSynchronize(stream), "sync")
    host = ctypes.c_uint32()
    ok(cu.cuMemcpyDtoH(ctypes.addressof(host), out, 4), "copy")
    return host.value


def set_enabled(ex: Any, chain: Chain, on: list[bool]) -> None:
    for node, enabled in zip(chain.nodes, on, strict=True):
        ok(cu.cuGraphNodeSetEnabled(ex, node, int(enabled)), "cuGraphNodeSetEnabled")


def semantics(func: Any, out: int, stream: Any, keep: list[Any]) -> dict[str, Any]:
    spec = [("k", 1), ("k", 2, 2), ("m", 5), ("k", 3), ("k", 4, 4), ("k", 5)]
    spec2 = [("k", 11), ("k", 12, 2), ("m", 15), ("k", 13), ("k", 14, 4), ("k", 15)]
    a, b = Chain(func, out, spec, keep), Chain(func, out, spec2, keep)
    ex = ok(cu.cuGraphInstantiate(a.graph, 0), "instantiate")
    r: dict[str, Any] = {}
    on = [True] * 6
    r["all_on"] = (run(ex, stream, out), expect(spec, on))
    on = [True, False, False, True, True, False]  # a cluster kernel, a memset, the last node off
    set_enabled(ex, a, on)
    r["some_off"] = (run(ex, stream, out), expect(spec, on))
    err, info = cu.cuGraphExecUpdate(ex, b.graph)
    r["update"] = f"{err} {getattr(info, 'result', info)}"
    states = [ok(cu.cuGraphNodeGetEnabled(ex, n), "get enabled") for n in a.nodes]
    r["enabled_after_update"] = [int(s) for s in states]
    got = run(ex, stream, out)
    r["after_update"] = {
        "got": got, "if_kept": expect(spec2, on), "if_reset": expect(spec2, [True] * 6)
    }
    on2 = [False, True, True, False, False, True]
    set_enabled(ex, a, on2)
    r["flipped_after_update"] = (run(ex, stream, out), expect(spec2, on2))
    r["ok"] = all(x[0] == x[1] for x in (r["all_on"], r["some_off"], r["flipped_after_update"]))
    return r


def memset_shapes(func: Any, out: int, stream: Any, keep: list[Any]) -> list[dict[str, Any]]:
    """k → memset → k with the memset disabled, per memset shape: did the memset still write?"""
    rows = []
    for size, width in ((1, 4), (1, 1), (1, 64), (1, 4096), (2, 2), (2, 64), (4, 1), (4, 16), (4, 1024)):
        value = {1: 0x05, 2: 0x0005, 4: 5}[size]
        spec = [("k", 1), ("m", value, size, width), ("k", 2)]
        ch = Chain(func, out, spec, keep)
        ex = ok(cu.cuGraphInstantiate(ch.graph, 0), "instantiate")
        set_enabled(ex, ch, [True, False, True])
        got = run(ex, stream, out)
        word = bytearray(expect(spec[:1], [True]).to_bytes(4, "little"))  # out after the first kernel
        written = min(4, size * width)
        word[:written] = (value.to_bytes(size, "little") * 4)[:written]
        skipped = expect(spec, [True, False, True])
        if_ran = (int.from_bytes(word, "little") * 3 + 2) & 0xFFFFFFFF
        rows.append({"element_size": size, "width": width, "got": got, "if_skipped": skipped,
                     "if_ran": if_ran, "inert": got == skipped})
        ok(cu.cuGraphExecDestroy(ex), "destroy")
    return rows


def costs(func: Any, out: int, stream: Any, keep: list[Any], n: int, extra: int) -> dict[str, Any]:
    """Instantiate and run a chain of n nodes, and one of n + extra with the extra ones disabled."""
    base = [("k", i % 7) for i in range(n)]
    step = n // extra if extra else n + 1
    union: list[tuple[Any, ...]] = []
    on: list[bool] = []
    for i, item in enumerate(base):
        union.append(item)
        on.append(True)
        if (i + 1) % step == 0:
            union.append(("k", 9))
            on.append(False)
    r: dict[str, Any] = {"nodes": n, "union_nodes": len(union)}
    for name, spec, mask in (("plain", base, None), ("union", union, on)):
        ch = Chain(func, out, spec, keep)
        t = time.perf_counter()
        ex = ok(cu.cuGraphInstantiate(ch.graph, 0), "instantiate")
        r[f"{name}_instantiate_ms"] = round((time.perf_counter() - t) * 1e3, 2)
        if mask is not None:
            t = time.perf_counter()
            set_enabled(ex, ch, mask)
            r["set_enabled_us_per_node"] = round((time.perf_counter() - t) * 1e6 / len(mask), 3)
            r["union_result_ok"] = run(ex, stream, out) == expect(spec, mask)
        ok(cu.cuGraphUpload(ex, stream), "upload")
        run(ex, stream, out)
        e0, e1 = ok(cu.cuEventCreate(0), "ev"), ok(cu.cuEventCreate(0), "ev")
        ok(cu.cuEventRecord(e0, stream), "rec")
        for _ in range(50):
            ok(cu.cuGraphLaunch(ex, stream), "launch")
        ok(cu.cuEventRecord(e1, stream), "rec")
        ok(cu.cuEventSynchronize(e1), "sync")
        r[f"{name}_run_ms"] = round(ok(cu.cuEventElapsedTime(e0, e1), "elapsed") / 50, 4)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args()
    ok(cu.cuInit(0), "cuInit")
    dev = ok(cu.cuDeviceGet(0), "cuDeviceGet")
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev), "retain")
    ok(cu.cuCtxSetCurrent(ctx), "set ctx")
    func = kernel(a.arch, SRC, b"step")
    out = int(ok(cu.cuMemAlloc(1 << 16), "cuMemAlloc"))
    stream = ok(cu.cuStreamCreate(0), "cuStreamCreate")
    keep: list[Any] = []
    report: dict[str, Any] = {"semantics": semantics(func, out, stream, keep)}
    print(json.dumps(report["semantics"]))
    report["memset_shapes"] = memset_shapes(func, out, stream, keep)
    print(json.dumps(report["memset_shapes"]))
    report["costs"] = [costs(func, out, stream, keep, 2450, extra) for extra in (0, 250, 250, 0)]
    for c in report["costs"]:
        print(json.dumps(c))
    name = ok(cu.cuDeviceGetName(64, dev), "name").split(b"\0")[0].decode()
    report["device"], report["driver_api"] = name, ok(cu.cuDriverGetVersion(), "version")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "diag-union.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
