"""Why LOAD's background work runs ~5x slower while the engine builds its model (a cold pod) than
once the model is built (a warm pod): template preparation took 2.9-3.5 s instead of ~0.14 s on
an H100, and shortening the switch interval (ember/runtime/gil.py) barely changed it.

One fresh process per run (the true-cost bench's `cold` or `warm` role, ember_bench.true_cost)
with, per thread:
- wall time and CPU time (`time.thread_time`) of LOAD's background threads and of the build;
- the time spent inside each driver call (`cuda.bindings.driver`, by name) and each libember
  control call (`ember.native.Interposer`), per thread: waiting for the driver shows there;
- GIL hand-back latency: a probe thread sleeps 1 ms over and over; how much later than 1 ms it
  runs again (p50/p99/max, while the build runs and after) is how long a thread that dropped the
  GIL waits to get it back.

    EMBER_MODE=load LD_PRELOAD=libember.so python benchmarks/results/diag/diag_cold_contention.py \\
        STORE IDENTITY --role cold --out OUT.json
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

CALLS: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
SPANS: dict[str, dict[str, float]] = {}


def _timed(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            c = CALLS[threading.current_thread().name][name]
            c[0] += 1
            c[1] += (time.perf_counter() - t) * 1e3

    return wrapper


def _instrument() -> None:
    """Times every driver call made as `cu.<name>(...)` and every libember control call."""
    from cuda.bindings import driver as cu

    from ember.native import Interposer

    for name in dir(cu):
        fn = getattr(cu, name)
        if name.startswith("cu") and callable(fn) and not isinstance(fn, type):  # cuuint64_t is a type
            setattr(cu, name, _timed(f"cu.{name}", fn))
    for name, fn in list(vars(Interposer).items()):
        if inspect.isfunction(fn) and not name.startswith("__"):  # not attach (a classmethod)
            setattr(Interposer, name, _timed(f"ember.{name}", fn))


def _span(name: str, fn: Any) -> Any:
    """Wall and CPU time of one thread's whole run of `fn`."""

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        w, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            SPANS[f"{name} ({threading.current_thread().name})"] = {
                "wall_ms": (time.perf_counter() - w) * 1e3,
                "cpu_ms": (time.thread_time() - c) * 1e3,
                "start_s": w,
            }

    return wrapper


def _spans() -> None:
    from ember.engines.decode.model import DecodeWorkload
    from ember.runtime import restore
    from ember.runtime.graphs import need

    restore.ArchiveRestore._reconstruct = _span("reconstruct", restore.ArchiveRestore._reconstruct)
    restore.ArchiveRestore._read_blobs = _span("read_blobs", restore.ArchiveRestore._read_blobs)
    need.Dedicator.run = _span("dedicate", need.Dedicator.run)
    DecodeWorkload.build = _span("build", DecodeWorkload.build)


class Probe:
    """Sleeps 1 ms in a loop; each wake-up's lateness is a GIL hand-back latency sample."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="probe", daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            self.samples.append((t, (time.perf_counter() - t) * 1e3 - 1.0))

    def summary(self, start: float, end: float) -> dict[str, float]:
        late = sorted(s for t, s in self.samples if start <= t < end)
        if not late:
            return {"n": 0}
        p99 = late[int(0.99 * (len(late) - 1))]
        return {
            "n": len(late),
            "p50_ms": statistics.median(late),
            "p99_ms": p99,
            "max_ms": late[-1],
            "sum_ms": sum(late),
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("identity")
    ap.add_argument("--role", default="cold", choices=("cold", "warm"))
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    from ember_bench import true_cost

    _instrument()
    _spans()
    probe = Probe()
    probe.thread.start()
    t0 = time.perf_counter()
    res = true_cost.role(a.role, {"store": a.store, "identity": a.identity})
    t1 = time.perf_counter()
    probe.stop.set()
    build = next((v for k, v in SPANS.items() if k.startswith("build")), None)
    split = build["start_s"] + build["wall_ms"] / 1e3 if build else t0
    out = {
        "role": a.role,
        "switch_interval_s": sys.getswitchinterval(),
        "result": {k: v for k, v in res.items() if isinstance(v, (int, float))},
        "spans": SPANS,
        "gil_probe": {"during_build": probe.summary(t0, split), "after_build": probe.summary(split, t1)},
        "calls": {
            thread: dict(
                sorted(
                    ((n, {"count": c, "ms": round(ms, 2)}) for n, (c, ms) in calls.items()),
                    key=lambda kv: -kv[1]["ms"],
                )[:25]
            )
            for thread, calls in CALLS.items()
        },
    }
    text = json.dumps(out, indent=1, default=str)
    if a.out:
        Path(a.out).write_text(text)
    print(text[:4000])
    sys.stdout.flush()
    import os

    os._exit(0)


if __name__ == "__main__":
    main()
