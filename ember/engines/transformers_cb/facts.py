"""The continuous-batching adapter's side of an archive: identity, engine facts, SAVE and LOAD calls.

SAVE hands the kept torch CUDAGraphs, keyed `(io_pair, *engine key)`, and the engine facts
(the resolved `CBSizing` above all) to the graph runtime; LOAD reads the sizing back from the
manifest's `engine` section before the engine is built, then asks the runtime for the restored
graphs. The runtime (`ember.runtime.save` / `ember.runtime.load`) owns everything in between:
walking, proving, the archive format, the compatibility check, rebuilding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ember.engines.transformers_cb.hooks import ENGINE, engine_version
from ember.engines.transformers_cb.keys import CBSizing, enumerate_keys
from ember.identity import ArchiveIdentity


class ArchiveRefused(RuntimeError):
    """The archive cannot serve this engine (wrong engine, sizing missing, runtime refusal)."""


def cb_identity(
    model: str,
    sizing: CBSizing,
    *,
    revision: str = "random-weights",
    dtype: str = "bfloat16",
    gpu_product: str = "",
) -> ArchiveIdentity:
    """The identity of a continuous-batching archive: the key set follows from the sizing."""
    q_sizes = sorted({k[0] for k in enumerate_keys(sizing)})
    return ArchiveIdentity(
        model=model,
        revision=revision,
        engine=ENGINE,
        engine_version=engine_version() or "unknown",
        capture_sizes=tuple(q_sizes),
        graph_mode="cb-varlen+decode" if sizing.decode_path else "cb-varlen",
        compile={
            "q_interval": str(sizing.q_padding_interval_size),
            "kv_interval": str(sizing.kv_padding_interval_size),
            "num_blocks": str(sizing.num_blocks),
            "block_size": str(sizing.block_size),
        },
        dtype=dtype,
        max_num_tokens=sizing.max_batch_tokens,
        max_batch=sizing.max_requests_per_batch,
        gpu_product=gpu_product,
    )


def manifest_path(archive: str | Path) -> Path:
    """The manifest of an archive directory (or the manifest file itself)."""
    path = Path(archive)
    return path / "manifest" if path.is_dir() else path


def read_engine_facts(archive: str | Path) -> dict[str, Any]:
    """The manifest's `engine` section, checked to be this adapter's (ArchiveRefused otherwise)."""
    from ember.archive.manifest import ManifestError, loads

    path = manifest_path(archive)
    try:
        manifest = loads(path.read_bytes())
    except (OSError, ManifestError) as exc:
        raise ArchiveRefused(f"manifest unreadable at {path}: {exc}") from exc
    facts = dict(manifest.engine)
    if facts.get("kind") != ENGINE:
        raise ArchiveRefused(f"archive is for engine {facts.get('kind')!r}, not {ENGINE!r}")
    if facts.get("version") != engine_version():
        raise ArchiveRefused(
            f"archive saved with transformers {facts.get('version')}, here {engine_version()}"
        )
    return facts


def read_sizing(archive: str | Path) -> CBSizing:
    facts = read_engine_facts(archive)
    try:
        return CBSizing.from_json(facts["sizing"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ArchiveRefused(f"archive has no usable engine sizing: {exc}") from exc
