"""Where a rank's collective capture time goes (`ember.runtime.comm.Splicer`): one process, a real
one-rank NCCL communicator, N distinct all-reduces captured one by one, each phase timed
(cuStreamBeginCapture, the NCCL call, cuStreamEndCapture), then the same N in ONE capture.

    python benchmarks/results/diag/diag_splice.py [N]      (GPU; prints JSON)
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time
from typing import Any


def main() -> None:  # long: one linear measurement script
    import torch
    from cuda.bindings import driver as cu

    from ember.engines.decode.parallel import Parallel, init_process_group
    from ember.runtime import comm
    from ember.runtime.graphs.driver import check
    from ember.runtime.session import ensure_context

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    ensure_context()
    init_process_group(Parallel(collectives=True), stub=False)
    buf = torch.zeros(1 << 24, dtype=torch.bfloat16, device="cuda")
    comm_ptr = comm.torch_communicator()
    lib = ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD | os.RTLD_NOW)  # the one torch loaded
    stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    vp, sz, ci = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    ptr = buf.data_ptr()

    def call(i: int) -> int:  # distinct counts: distinct collectives, as a graph set has
        return int(lib.ncclAllReduce(vp(ptr), vp(ptr + 4096), sz(4096 + 64 * i), ci(9), ci(0), vp(comm_ptr),
                                     vp(int(stream))))

    phases: dict[str, list[float]] = {"begin": [], "nccl": [], "end": [], "total": []}
    graphs = []
    for i in range(n):
        t0 = time.perf_counter()
        check(cu.cuStreamBeginCapture(stream, mode), "begin")
        t1 = time.perf_counter()
        rc = call(i)
        t2 = time.perf_counter()
        graphs.append(check(cu.cuStreamEndCapture(stream), "end"))
        t3 = time.perf_counter()
        assert rc == 0, rc
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
            phases[k].append(v * 1e3)
    t = time.perf_counter()
    check(cu.cuStreamBeginCapture(stream, mode), "begin")
    for i in range(n):
        call(i)
    one = check(cu.cuStreamEndCapture(stream), "end")
    batched_ms = (time.perf_counter() - t) * 1e3
    out: dict[str, Any] = {
        k: {"median": statistics.median(v), "p90": sorted(v)[int(0.9 * (len(v) - 1))], "sum": sum(v)}
        for k, v in phases.items()
    }
    out.update(n=n, one_capture_of_all_ms=batched_ms, first_total_ms=phases["total"][0])
    for g in [*graphs, one]:
        cu.cuGraphDestroy(g)
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
