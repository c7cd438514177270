"""vLLM's compile cache, shipped with the archive: SAVE packs it, LOAD puts it back before vLLM compiles.

vLLM 0.26 keeps what torch.compile produced (AOT-compiled models, Inductor artifacts) under
`$VLLM_CACHE_ROOT/torch_compile_cache/`: `<hash>/rank_<r>_<dp>/<prefix>/` and
`torch_aot_compile/<hash>/`, the hashes over the config, the traced code, the compiler and the
environment. A fresh pod has none of it and compiles for tens of seconds before it could restore a
single graph; with SAVE's tree it loads the compiled code instead. A tree whose hashes do not match
this process (another config, another vLLM) is never read by vLLM: it compiles, as it would
without ember, and the graphs are still checked against the archive's sizing before any launch.

The archive stores the tree as an uncompressed tar (the bundle compresses every blob with zstd).
Unpacking never overwrites: an entry that exists (vLLM's own, a previous start's) is kept, and a
new one appears whole (extracted aside, then renamed), so a crash midway leaves no half-written
entry for vLLM to trip over. tarfile's "data" filter refuses members that would land outside the
tree, links out of it, and device files.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

NAME = "vllm-compile-cache.tar"  # the attachment's name in the archive
SUBDIR = "torch_compile_cache"


def cache_root() -> Path:
    """`VLLM_CACHE_ROOT` as vLLM resolves it (`vllm.envs`): the variable, else
    `$XDG_CACHE_HOME/vllm`, else `~/.cache/vllm`."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    default = os.path.join(xdg, "vllm")
    return Path(os.path.expanduser(os.environ.get("VLLM_CACHE_ROOT") or default))


def _member(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if info.name.endswith(".lock"):  # vLLM's and Inductor's file locks are per process
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def pack(root: Path | None = None) -> bytes | None:
    """The compile cache tree as a tar; None when this process's vLLM compiled nothing."""
    base = (root or cache_root()) / SUBDIR
    if not base.is_dir() or not any(p.is_file() for p in base.rglob("*")):
        return None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(base.iterdir()):
            tar.add(entry, arcname=entry.name, filter=_member)
    return buf.getvalue()


def _merge(src: Path, dest: Path) -> tuple[int, int]:
    """Move what `dest` lacks from `src` into it; (entries placed, entries kept)."""
    placed = kept = 0
    for entry in sorted(src.iterdir()):
        target = dest / entry.name
        if target.is_dir() and entry.is_dir() and not target.is_symlink():
            p, k = _merge(entry, target)
            placed, kept = placed + p, kept + k
            continue
        if target.exists() or target.is_symlink():
            kept += 1
            continue
        try:
            os.rename(entry, target)
            placed += 1
        except OSError:  # another process placed it first
            kept += 1
    return placed, kept


def unpack(data: bytes, root: Path | None = None) -> dict[str, Any]:
    """Put the packed tree under `<root>/torch_compile_cache`; what was placed, kept and how long.
    Raises tarfile.TarError (a damaged or unsafe tar) with nothing placed."""
    t = time.perf_counter()
    base = (root or cache_root()) / SUBDIR
    base.mkdir(parents=True, exist_ok=True)
    aside = Path(tempfile.mkdtemp(prefix=".ember-unpack-", dir=base))
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            tar.extractall(aside, filter="data")
        placed, kept = _merge(aside, base)
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    return {"placed": placed, "kept": kept, "bytes": len(data),
            "seconds": round(time.perf_counter() - t, 4), "dir": str(base)}


def key_of(local_cache_dir: str) -> str:
    """vLLM's cache dir of one model (`compilation_config.local_cache_dir`) relative to
    `<cache root>/torch_compile_cache`; "" when it is not under such a tree."""
    _, sep, tail = local_cache_dir.partition(f"/{SUBDIR}/")
    return tail if sep else ""


def model_dir(facts: dict[str, Any]) -> str:
    """Where this process's vLLM will look for SAVE's compiled model: SAVE's directory
    (`compile_cache_key`) under this process's cache root; "" when SAVE compiled nothing."""
    key = str(facts.get("compile_cache_key") or "")
    return str(cache_root() / SUBDIR / key) if key else ""
