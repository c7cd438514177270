"""vLLM's caches, shipped with the archive: SAVE packs them, LOAD puts them back before vLLM reads them.

Three trees under vLLM's cache root (`$VLLM_CACHE_ROOT`) decide how long a fresh pod takes to start:
- `torch_compile_cache/`: what torch.compile produced (AOT-compiled models, Inductor artifacts),
  `<hash>/rank_<r>_<dp>/<prefix>/` and `torch_aot_compile/<hash>/`, the hashes over the config,
  the traced code, the compiler and the environment. Without it vLLM compiles for tens of seconds
  before it could restore a single graph;
- `modelinfos/`: what vLLM's model registry learnt about the architecture's class. Without it,
  vLLM inspects the class in a subprocess that imports vLLM again, ~20 s before the engine even
  starts (H200, 0.26.0). Each file carries the hash of the model module it describes;
- `triton-home/`: the Triton home and cache ember gives SAVE's and LOAD's vLLM processes
  (`own_triton_home`), where every Triton kernel SAVE compiles lands: Inductor's, and vLLM's own
  (the model runner's input preparation, the sampler, the MoE kernels), which vLLM's warm-up
  compiles after the graphs are captured (SAVE publishes after it: `plugin.publish_saved`).
  Without it a fresh pod compiles them again at start, or finds them in a `~/.triton` a previous
  process on the machine left.
A tree whose hashes do not match this process (another config, another vLLM) is never read by
vLLM: it compiles or inspects, as it would without ember, and the graphs are still checked against
the archive's sizing before any launch.

The archive stores the three as one uncompressed tar, members relative to the cache root (the bundle
compresses every blob with zstd). Unpacking never overwrites: an entry that exists (vLLM's own, a
previous start's) is kept, and a new one appears whole (extracted aside, then renamed), so a crash
midway leaves no half-written entry for vLLM to trip over. tarfile's "data" filter refuses members
that would land outside the root, links out of it, and device files; members outside the three trees
are dropped.
"""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

NAME = "vllm-cache.tar"  # the attachment's name in the archive
SUBDIR = "torch_compile_cache"
TRITON_HOME = "triton-home"
TREES = (SUBDIR, "modelinfos", TRITON_HOME)
PLACED = "EMBER_VLLM_CACHES_PLACED"  # set by the plugin: the cache root the archive's caches went to


def cache_root() -> Path:
    """`VLLM_CACHE_ROOT` as vLLM resolves it (`vllm.envs`): the variable, else
    `$XDG_CACHE_HOME/vllm`, else `~/.cache/vllm`."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    default = os.path.join(xdg, "vllm")
    return Path(os.path.expanduser(os.environ.get("VLLM_CACHE_ROOT") or default))


def own_triton_home() -> Path:
    """SAVE and LOAD: Triton's home and cache under vLLM's cache root, set for this process and
    the vLLM processes it starts (inherited ones too: what is compiled there must travel with the
    archive). The cache is named, not left to Triton's default: Inductor points Triton at its own
    cache on its first kernel unless TRITON_CACHE_DIR is set (runtime/triton_heuristics.py), which
    SAVE reaches while compiling and LOAD, loading compiled code, may never; vLLM's own kernels
    would then be compiled into one place and looked for in another."""
    home = cache_root() / TRITON_HOME
    os.environ["TRITON_HOME"] = str(home)
    os.environ["TRITON_CACHE_DIR"] = str(home / ".triton" / "cache")
    pin_ptxas()
    return home


def torch_ptxas() -> str:
    """torch's own ptxas (`torch/bin/ptxas`, in CUDA wheels), '' where there is none; torch is not
    imported."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return ""
    ptxas = Path(spec.origin).parent / "bin" / "ptxas"
    return str(ptxas) if ptxas.is_file() and os.access(ptxas, os.X_OK) else ""


def pin_ptxas() -> None:
    """SAVE and LOAD: Triton's ptxas named from the start (TRITON_PTXAS_PATH, unless set), torch's as
    Inductor names it. Every Triton kernel's cache key holds the ptxas version, which Triton reads
    once a process, at its first compile (triton/backends/nvidia/compiler.py `get_ptxas_version`,
    lru-cached), and Inductor sets the variable only when it compiles or loads a kernel on its own
    path (torch/_inductor/async_compile.py `_set_triton_ptxas_path`). A process that reaches a
    Triton compile before that (or never takes that path: compiled code loaded from vLLM's single
    AOT artifact) keys every kernel by Triton's bundled ptxas, so none of SAVE's is found."""
    if not os.environ.get("TRITON_PTXAS_PATH") and (ptxas := torch_ptxas()):
        os.environ["TRITON_PTXAS_PATH"] = ptxas


def placed_here() -> bool:
    """Whether the plugin already put the archive's caches under this process's cache root."""
    return os.environ.get(PLACED) == str(cache_root())


def _member(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if info.name.endswith(".lock"):  # vLLM's and Inductor's file locks are per process
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def pack(root: Path | None = None) -> bytes | None:
    """The trees as one tar; None when this process wrote none of them."""
    root = root or cache_root()
    trees = [t for t in TREES if (root / t).is_dir() and any(p.is_file() for p in (root / t).rglob("*"))]
    if not trees:
        return None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for tree in trees:
            for entry in sorted((root / tree).iterdir()):
                tar.add(entry, arcname=f"{tree}/{entry.name}", filter=_member)
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
    """Put the packed trees under `root` (vLLM's cache root); what was placed, kept and how long.
    Raises tarfile.TarError (a damaged or unsafe tar) with nothing placed."""
    t = time.perf_counter()
    root = root or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    aside = Path(tempfile.mkdtemp(prefix=".ember-unpack-", dir=root))
    placed = kept = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            tar.extractall(aside, filter="data")
        for tree in TREES:
            if (aside / tree).is_dir() and not (aside / tree).is_symlink():
                (root / tree).mkdir(exist_ok=True)
                p, k = _merge(aside / tree, root / tree)
                placed, kept = placed + p, kept + k
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    return {"placed": placed, "kept": kept, "bytes": len(data),
            "seconds": round(time.perf_counter() - t, 4), "dir": str(root)}


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


def saved_rank_dir(key: str) -> str:
    """The `rank_<rank>_<dp rank>` directory SAVE compiled into, from its `compile_cache_key`."""
    return next((part for part in key.split("/") if part.startswith("rank_")), "")


def alias_rank(key: str, here: str, root: Path | None = None) -> int:
    """vLLM keeps compiled code per rank (`<hash>/rank_<r>_<d>/`, under both trees of
    torch_compile_cache); each directory SAVE's rank compiled into is copied to this rank's name
    `here` where vLLM has none yet (copied aside, then renamed: another rank of the node may do
    the same at once). Returns how many were copied."""
    saved = saved_rank_dir(key)
    base = (root or cache_root()) / SUBDIR
    if not saved or saved == here or not base.is_dir():
        return 0
    copied = 0
    found = [p for p in base.glob(f"**/{saved}") if p.is_dir() and len(p.relative_to(base).parts) <= 3]
    for src in sorted(found):
        dest = src.with_name(here)
        if dest.exists():
            continue
        aside = Path(tempfile.mkdtemp(prefix=".ember-rank-", dir=src.parent))
        try:
            shutil.copytree(src, aside / here, symlinks=True,
                            ignore=shutil.ignore_patterns("*.lock"))
            os.rename(aside / here, dest)
            copied += 1
        except OSError:  # another process placed it first
            pass
        finally:
            shutil.rmtree(aside, ignore_errors=True)
    return copied
