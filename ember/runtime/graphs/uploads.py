"""Execs uploaded to the device off the request path (a first launch would otherwise upload).

`Uploader.upload(execs)` uploads on the library's own stream and waits for it. `behind(execs,
then)` (EMBER_UPLOAD_BEHIND=1, not the default yet) does the same on the uploader's one thread, in
the order asked, then calls `then()`: the builder goes on to the next templates while these
upload. An upload is host work inside
`cuGraphUpload` (~3 ms a template of the Llama-3-8B shape on an H100), and the driver lets it
overlap the next instantiation: the time to every template ready on top of libember's builder
call fell from 22-32 % to 15-16 % in the same run
(benchmarks/results/true-cost-h100-20261125-pairs.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from cuda.bindings import driver as cu

from ember.runtime.graphs.driver import OK


class Uploader:
    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.ms = 0.0  # wall time of every upload, waits included
        self.call_ms = 0.0  # of which in cuGraphUpload calls (the rest waited for the device)
        self._stream: Any = None
        self._thread: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()  # one stream: the uploader's thread and a caller's

    def upload(self, execs: list[Any]) -> float:
        """Upload `execs` and wait; returns the milliseconds (0 for a driver without uploads:
        then the first launch uploads)."""
        if not execs:
            return 0.0
        with self._lock:
            t = time.perf_counter()
            try:
                if self._stream is None:
                    err, stream = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
                    if err != OK:
                        return 0.0
                    self._stream = stream
                for ex in execs:
                    cu.cuGraphUpload(ex, self._stream)
                self.call_ms += (time.perf_counter() - t) * 1e3
                cu.cuStreamSynchronize(self._stream)
            except RuntimeError:  # no such entry points (a stand-in driver)
                return 0.0
            ms = (time.perf_counter() - t) * 1e3
            self.ms += ms
            return ms

    def behind(self, execs: list[Any], then: Callable[[], None]) -> None:
        """Upload on the uploader's thread (the library's context made current there), then
        `then()`, also when the upload failed."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="ember-upload")

        def run() -> None:
            try:
                cu.cuCtxSetCurrent(self.ctx)
                self.upload(execs)
            finally:
                then()

        self._pending.append(self._thread.submit(run))

    def drain(self) -> None:
        """Wait for every upload asked for with `behind`."""
        pending, self._pending = self._pending, []
        wait(pending)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._stream is not None:
            cu.cuStreamDestroy(self._stream)
            self._stream = None
