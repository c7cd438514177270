"""LOAD's background threads and the GIL.

While LOAD works in the background, the engine builds its model on the main thread, holding the
GIL most of the time. Each time a background thread drops the GIL (every driver, libember,
numpy, zstd or file call does), it waits to get it back until the main thread lets go: at a
bytecode boundary once the switch interval (5 ms by default) has passed, or when a C call
releases it. LOAD's reconstruction drops it over a thousand times. During a Llama-3-8B build on
an H100 its wall time was 4.5-5.3 s for ~0.9 s of CPU (0.75 s once the model is built), and a
probe thread waited p50 1.1 ms, p99 30-44 ms to get the GIL back; the long waits are C calls of
the build that hold the GIL, which no switch interval shortens
(benchmarks/results/true-cost-h100-20261125-gil.md).

While LOAD's background work runs, the switch interval is shortened to EMBER_SWITCH_INTERVAL_US
(default 200 µs; 0 leaves the interpreter's): the probe's p50 wait was 0.45 ms, the
reconstruction 3.3-4.2 s. It only matters while two threads want the GIL, and then it bounds
how long either waits at a bytecode boundary: the main thread's waits get shorter too. The
previous value comes back when the last background user ends (a value the engine sets meanwhile
is overwritten then).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ember import settings

DEFAULT_US = 200.0

_lock = threading.Lock()
_users = 0
_saved = 0.0


def interval_s() -> float:
    """The switch interval LOAD's background work runs under (0: leave the interpreter's)."""
    return max(settings.number("EMBER_SWITCH_INTERVAL_US"), 0.0) / 1e6


@contextmanager
def short_switch_interval() -> Iterator[None]:
    """Run the block with the switch interval at most `interval_s()`; nested and concurrent uses
    share it, the first one in saves the interpreter's value, the last one out restores it."""
    global _users, _saved
    target = interval_s()
    if target <= 0:
        yield
        return
    with _lock:
        if _users == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved, target))
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                sys.setswitchinterval(_saved)
