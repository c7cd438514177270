"""Where a block's Python time goes, for a diagnosis: `profiled(folder, name)` runs the block
under cProfile and writes its top functions, by cumulative and by own time, to
`folder`/<name>-<pid>.txt. A function only the block's first pass calls (a kernel's first load, a
cache filled once) shows there with all its time. Only the calling thread is profiled."""

from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("ember")


@contextmanager
def profiled(folder: str, name: str, top: int = 60) -> Iterator[None]:
    """The block profiled where `folder` is set (nothing otherwise). A profiler that cannot start,
    or a file that cannot be written, is logged; the block's own outcome is never changed."""
    if not folder:
        yield
        return
    prof = cProfile.Profile()
    try:
        prof.enable()
    except ValueError as exc:  # another profiler holds the interpreter's hook (3.12+): run as is
        log.warning("ember: %s not profiled: %s", name, exc)
        yield
        return
    try:
        yield
    finally:
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("cumulative").print_stats(top)
        stats.sort_stats("tottime").print_stats(top)
        path = Path(folder) / f"{name}-{os.getpid()}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(out.getvalue())
            log.info("ember: %s profile in %s", name, path)
        except OSError as exc:
            log.warning("ember: %s profile not written: %s", name, exc)
