"""ember's own threads named for the OS. Python 3.12 leaves every thread it starts with the
process's name, so a native line (libember's divergence, `top -H`, a core dump) could not say
which thread it was: each of ember's threads calls `name_this_thread` first."""

from __future__ import annotations

import ctypes
import threading

LIMIT = 15  # bytes pthread_setname_np takes, its terminator aside


def name_this_thread() -> bool:
    """The calling thread's Python name given to the OS thread (cut to 15 bytes); False where the
    C library cannot."""
    name = threading.current_thread().name.encode()[:LIMIT]
    try:
        libc = ctypes.CDLL(None)
        libc.pthread_self.restype = ctypes.c_ulong
        return int(libc.pthread_setname_np(ctypes.c_ulong(libc.pthread_self()), name)) == 0
    except (OSError, AttributeError):
        return False
