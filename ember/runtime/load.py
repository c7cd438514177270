"""LOAD in a fresh process (LD_PRELOAD=libember.so EMBER_MODE=load): restore the graphs SAVE
proved, at the same addresses, without capturing.

Order matters and every check comes before anything is launched (`ember.runtime.restore`):
1. compatibility key against the real GPU/driver/CUDA/torch/env → `LoadRefused(reason)`;
2. the allocation log read and imported; on a background thread from here on: every other blob
   fetched and its digest verified, kernel images handed to libember for proactive loading
   (execution order), one template per topology group built and instantiated (`GraphLibrary`),
   while
4. the workload is built in SAVE's order (weights, the KV cache at the recorded size: no memory
   profiling), static buffers checked against SAVE's addresses, the capture window replayed
   (divergence → refuse);
5. the templates handed over once the background thread is done.
Any refusal means: capture natively instead. Never a wrong graph.

Crash safety: a launch of a bad graph can kill the process with a sticky CUDA error, and a
restarted engine must not try again. `attempt_marker(run_dir)` writes the handoff marker
(`ember.handoff.MARKER_FILE`) before the first launch and removes it once launches succeeded;
`ember.handoff.wait_for_archive` turns a leftover marker into a native-capture fallback.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember import handoff
from ember.native import Interposer
from ember.runtime.restore import ArchiveRestore, LoadRefused, release_cached_memory

__all__ = ["LoadRefused", "Loaded", "attempt_marker", "release_cached_memory", "run_load"]

if TYPE_CHECKING:  # torch and CUDA modules are imported where LOAD runs, not for the marker helpers
    import torch

    from ember.engines.decode.model import DecodeWorkload
    from ember.runtime import publish
    from ember.runtime.graphs.templates import GraphLibrary, RestoredGraph


@dataclass
class Loaded:
    library: GraphLibrary
    workload: DecodeWorkload
    archive: publish.Archive
    outputs: dict[tuple[int, ...], list[torch.Tensor]]
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def graphs(self) -> dict[tuple[int, ...], RestoredGraph]:
        return self.library.all_restored()

    def launch(self, key: tuple[int, ...]) -> None:
        self.library.launch(self.library.key_index(key))


@contextlib.contextmanager
def attempt_marker(run_dir: str | os.PathLike[str] | None, identity: str = "") -> Iterator[Path]:
    """Mark 'first launches of restored graphs in progress' in the handoff run directory.

    A process death inside leaves the marker; the next engine start in this pod reads it
    (handoff.wait_for_archive) and captures natively. Leaving normally, or by a Python
    exception (the caller falls back), removes it.
    """
    path = handoff.run_dir_from_env(run_dir) / handoff.MARKER_FILE
    handoff.write_json_atomic(
        path, {"identity": identity, "pid": os.getpid(), "started_at": time.time(), "stage": "first-launch"}
    )
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def previous_attempt_crashed(run_dir: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The marker a dead engine left behind, if any."""
    return handoff.read_json(handoff.run_dir_from_env(run_dir) / handoff.MARKER_FILE)


def run_load(
    store_uri: str,
    identity_hash: str,
    *,
    interposer: Interposer | None = None,
    perturb_first: bool = False,
    log: Any = print,
    model_dir: str | None = None,
) -> Loaded:
    """LOAD one archive into this process. Raises LoadRefused (caller captures natively).

    `model_dir`: where this machine holds the checkpoint of a `--model DIR` archive (default:
    the path SAVE read it from)."""
    import numpy as np
    import torch

    from ember.engines.decode.model import DecodeWorkload, OutputSpec
    from ember.runtime.save import ENGINE
    from ember.runtime.session import native_session

    tm: dict[str, Any] = {}
    t_all = time.perf_counter()
    ip = interposer or native_session("load", perturb_first=perturb_first)
    tm["session_ms"] = (time.perf_counter() - t_all) * 1e3
    restore = ArchiveRestore.open(ip, store_uri, identity_hash, ENGINE)
    try:
        engine = dict(restore.manifest.engine)
        if model_dir:  # the checkpoint lives elsewhere on this machine than where SAVE read it
            engine["weights"] = str(model_dir)
        t = time.perf_counter()
        workload = DecodeWorkload.from_config(engine)
        try:
            workload.build(kv_cache_bytes=int(engine["kv_cache_bytes"]), compile_fn=False)
        except (OSError, ValueError) as exc:  # CheckpointError included: weights missing or other shape
            raise LoadRefused(f"model weights not usable: {exc}") from exc
        tm["build_workload_ms"] = (time.perf_counter() - t) * 1e3
        if div := ip.divergence():
            raise LoadRefused(f"allocation sequence diverged from SAVE: {div}")
        here = workload.input_addresses()
        moved = {k: (hex(v), hex(here.get(k, 0))) for k, v in engine["inputs"].items() if here.get(k) != v}
        if moved:
            raise LoadRefused(f"static buffers are not where SAVE had them: {moved}")
        restore.replay()
        lib = restore.library()
        archive = restore.archive
        assert archive is not None  # read in full before library() returns
    except BaseException:
        restore.abandon()
        raise
    tm.update(restore.timings)
    if archive.rng_state:
        torch.cuda.set_rng_state(torch.from_numpy(np.frombuffer(archive.rng_state, dtype=np.uint8).copy()))
    outputs = {
        tuple(int(x) for x in k.split(",")): [OutputSpec(**o).tensor() for o in v]
        for k, v in engine["outputs"].items()
    }
    tm["total_ms"] = (time.perf_counter() - t_all) * 1e3
    tm["load_ms"] = tm["total_ms"] - tm["build_workload_ms"] - tm["session_ms"]
    log(
        f"Loaded {len(lib.keys)} graphs ({len(lib.groups)} templates) in {tm['load_ms']:.1f} ms "
        f"(+{tm['build_workload_ms']:.0f} ms building the model)"
    )
    return Loaded(lib, workload, archive, outputs, tm)
