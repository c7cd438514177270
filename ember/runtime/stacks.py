"""A SAVE or LOAD that does not end says where it is.

While SAVE or LOAD runs, every thread's Python stack goes to stderr each EMBER_STACKS_AFTER_S
seconds (the engine's log), so one that hangs names the call it waits in (a vLLM SAVE stuck after
its capture: benchmarks/results/h200-20261129c). A run that ends first prints nothing.
"""

from __future__ import annotations

import faulthandler
import io
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from ember import settings


@contextmanager
def dumped_while_stuck() -> Iterator[None]:
    """Every thread's stack to stderr each EMBER_STACKS_AFTER_S seconds until the block ends
    (0, or a stderr without a file descriptor: nothing). One process-wide timer (faulthandler's):
    an inner block ends the outer one's."""
    after = settings.number("EMBER_STACKS_AFTER_S")
    try:
        armed = after > 0 and sys.stderr.fileno() >= 0
    except (AttributeError, ValueError, io.UnsupportedOperation):
        armed = False
    if armed:
        faulthandler.dump_traceback_later(after, repeat=True, file=sys.stderr)
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()
