"""A SAVE or LOAD that does not end says where it is.

While SAVE or LOAD runs, every thread's Python stack goes to stderr each EMBER_STACKS_AFTER_S
seconds (the engine's log), so one that hangs names the call it waits in (a vLLM SAVE stuck after
its capture: benchmarks/results/h200-20261129c). A run that ends first prints nothing.

`exit_if_stuck` bounds a block that waits on peers: past its limit the process ends, stacks first.
faulthandler's watchdog is a C thread: it fires while the main thread waits in a collective
holding the GIL, where a Python timer would not run.
"""

from __future__ import annotations

import faulthandler
import io
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from ember import settings

_DUMPING = 0  # enclosing `dumped_while_stuck` blocks that armed the dumps


def _stderr_ok() -> bool:
    try:
        return sys.stderr.fileno() >= 0
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return False


@contextmanager
def dumped_while_stuck() -> Iterator[None]:
    """Every thread's stack to stderr each EMBER_STACKS_AFTER_S seconds until the block ends
    (0, or a stderr without a file descriptor: nothing). One process-wide timer (faulthandler's):
    an inner block ends the outer one's."""
    global _DUMPING
    after = settings.number("EMBER_STACKS_AFTER_S")
    armed = after > 0 and _stderr_ok()
    if armed:
        faulthandler.dump_traceback_later(after, repeat=True, file=sys.stderr)
        _DUMPING += 1
    try:
        yield
    finally:
        if armed:
            _DUMPING -= 1
            faulthandler.cancel_dump_traceback_later()


@contextmanager
def exit_if_stuck(after: float) -> Iterator[None]:
    """The process ends (every thread's stack to stderr, exit status 1) if the block has not ended
    after `after` seconds (0, or a stderr without a file descriptor: no limit). The stack dumps of
    an enclosing `dumped_while_stuck` start again when the block ends."""
    armed = after > 0 and _stderr_ok()
    if armed:
        faulthandler.dump_traceback_later(after, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()
            if _DUMPING:
                faulthandler.dump_traceback_later(settings.number("EMBER_STACKS_AFTER_S"), repeat=True,
                                                  file=sys.stderr)
