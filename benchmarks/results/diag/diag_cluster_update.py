"""Can cuGraphExecUpdate change a kernel node's cluster dimension?

Templates are split wherever a kernel node's cluster dimension differs (on an H100, 12 of the
Llama-3-8B shape's 24 splits). Merging those groups is only safe if an exec update applies the
new cluster dimension. This builds one-node graphs of a kernel that writes the size of the
cluster it ran in, instantiates one, updates it to the other and reads what the kernel saw.

    python benchmarks/results/diag/diag_cluster_update.py --out DIR      (needs nvcc and an sm_90 GPU)

Each case: the update's CUresult and CUgraphExecUpdateResult, and the cluster size the kernel
reported after the update (the new one if applied, the old one if stale).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from cuda.bindings import driver as cu

SRC = r"""
extern "C" __global__ void cluster_size(unsigned* out) {
  unsigned n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  if (threadIdx.x == 0) out[blockIdx.x] = n;
}
"""
GRID = 8
CASES = [
    ((1, 1, 1), (2, 1, 1)),
    ((2, 1, 1), (1, 1, 1)),
    (None, (2, 1, 1)),
    ((2, 1, 1), None),
    ((2, 1, 1), (4, 1, 1)),
]


def ok(res: tuple[Any, ...], what: str) -> Any:
    if int(res[0]) != 0:
        raise RuntimeError(f"{what}: {res[0]}")
    return res[1] if len(res) == 2 else res[1:]


def kernel(arch: str, src: str = SRC, name: bytes = b"cluster_size") -> Any:
    """Function `name` of the CUDA source `src`, built with nvcc for `arch` (diag_union.py too)."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.cu").write_text(src)
        subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-o", f"{d}/k.cubin", f"{d}/k.cu"], check=True)
        image = (Path(d) / "k.cubin").read_bytes()
    mod = ok(cu.cuModuleLoadData(image), "cuModuleLoadData")
    return ok(cu.cuModuleGetFunction(mod, name), "cuModuleGetFunction")


def one_node_graph(func: Any, out: int, cluster: tuple[int, int, int] | None, keep: list[Any]) -> Any:
    g = ok(cu.cuGraphCreate(0), "cuGraphCreate")
    arg = ctypes.c_uint64(out)
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    keep += [arg, argv]
    p = cu.CUDA_KERNEL_NODE_PARAMS()
    p.func = func
    p.gridDimX, p.gridDimY, p.gridDimZ = GRID, 1, 1
    p.blockDimX, p.blockDimY, p.blockDimZ = 32, 1, 1
    p.sharedMemBytes = 0
    p.kernelParams = ctypes.addressof(argv)
    node = ok(cu.cuGraphAddKernelNode(g, None, 0, p), "cuGraphAddKernelNode")
    if cluster is not None:
        v = cu.CUkernelNodeAttrValue()
        v.clusterDim.x, v.clusterDim.y, v.clusterDim.z = cluster
        attr = cu.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        ok((cu.cuGraphKernelNodeSetAttribute(node, attr, v)[0], None), "cuGraphKernelNodeSetAttribute")
    return g


def seen(ex: Any, stream: Any, out: int) -> list[int]:
    ok((cu.cuMemsetD32Async(out, 0, GRID, stream)[0], None), "memset")
    ok((cu.cuGraphLaunch(ex, stream)[0], None), "cuGraphLaunch")
    ok((cu.cuStreamSynchronize(stream)[0], None), "sync")
    host = (ctypes.c_uint32 * GRID)()
    ok((cu.cuMemcpyDtoH(ctypes.addressof(host), out, 4 * GRID)[0], None), "copy")
    return list(host)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args()
    ok((cu.cuInit(0)[0], None), "cuInit")
    dev = ok(cu.cuDeviceGet(0), "cuDeviceGet")
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev), "retain")
    ok((cu.cuCtxSetCurrent(ctx)[0], None), "set ctx")
    func = kernel(a.arch)
    out = int(ok(cu.cuMemAlloc(4 * GRID), "cuMemAlloc"))
    stream = ok(cu.cuStreamCreate(0), "cuStreamCreate")
    keep: list[Any] = []
    rows = []
    for before, after in CASES:
        ga, gb = one_node_graph(func, out, before, keep), one_node_graph(func, out, after, keep)
        ex = ok(cu.cuGraphInstantiate(ga, 0), "instantiate")
        row: dict[str, Any] = {"template": before, "update_to": after, "before": seen(ex, stream, out)[0]}
        err, info = cu.cuGraphExecUpdate(ex, gb)
        row["update"] = str(err).split(".")[-1]
        row["result"] = str(info.result).split(".")[-1]
        if int(err) == 0:
            row["after"] = seen(ex, stream, out)[0]
            want = after[0] if after else 1
            row["applied"] = row["after"] == want
        fresh = ok(cu.cuGraphInstantiate(gb, 0), "instantiate b")
        row["fresh_exec"] = seen(fresh, stream, out)[0]
        rows.append(row)
        print(json.dumps(row))
    a.out.mkdir(parents=True, exist_ok=True)
    name = ok(cu.cuDeviceGetName(64, dev), "name").split(b"\0")[0].decode()
    driver = ok(cu.cuDriverGetVersion(), "version")
    (a.out / "diag-cluster-update.json").write_text(
        json.dumps({"device": name, "driver_api": driver, "cases": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
