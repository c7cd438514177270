"""Archives put into a store for tests and benchmarks: a small valid identity, an archive of
random blobs under a manifest (fast; optionally filed under the wrong identity), and a real
archive written by the archive writer, of about a given size."""

from __future__ import annotations

import hashlib

from ember.archive.manifest import BlobEntry, GraphsSummary, Manifest
from ember.identity import ArchiveIdentity, CompatKey
from ember.store import Store


def sample_identity(tag: str = "bench") -> ArchiveIdentity:
    """A small, valid identity (the model name carries `tag`, so tags give distinct hashes)."""
    return ArchiveIdentity(model=f"ember-test/{tag}", engine="transformers", engine_version="0",
                           capture_sizes=(1, 2, 4, 8))


def write_blob_archive(
    store: Store,
    blob_sizes: list[int],
    identity: ArchiveIdentity | None = None,
    seed: int = 0,
    manifest_identity_hash: str | None = None,
) -> Manifest:
    """Put random blobs of `blob_sizes` bytes and a manifest naming them into `store` (manifest last).

    The first blob plays the graph table, the rest kernel images / allocation log. With
    `manifest_identity_hash` the manifest is filed under that hash while claiming another identity
    (a wrong-identity archive, for tests).
    """
    identity = identity or sample_identity()
    rng = __import__("random").Random(seed)
    entries = []
    for i, size in enumerate(blob_sizes):
        data = rng.randbytes(size)
        digest = store.put_blob(data)
        name = "graphs" if i == 0 else f"blob-{i}"
        entries.append(BlobEntry(name=name, sha256=digest, size=size, compressed_size=size, codec="none"))
    m = Manifest(
        identity=identity,
        identity_hash=identity.hash(),
        compat=CompatKey(gpu_name="NVIDIA H100 80GB HBM3", compute_capability="9.0", driver="580",
                         cuda="13.0"),
        graphs=GraphsSummary(table="graphs", table_version="1.0", count=4, keys=[[1], [2], [4], [8]],
                             nodes=0, kernels=0),
        blobs=entries,
    )
    store.put_manifest(manifest_identity_hash or m.identity_hash, m.to_json())
    return m


def write_bundle_archive(store: Store, total_mb: float, identity: ArchiveIdentity | None = None,
                         seed: int = 0) -> Manifest:
    """A real archive through the archive writer (`ember.archive.bundle.write_archive`): a
    synthetic graph set, its kernel images, plus random (incompressible) extra images and an
    allocation log bringing the stored size to about `total_mb` MB."""
    import random

    from ember.archive.bundle import write_archive
    from ember_testing.synthetic import synthetic_graphset, synthetic_images

    rng = random.Random(seed)
    images: dict[str, bytes] = dict(synthetic_images())
    sizes = archive_shape(total_mb)
    for size in sizes[1:-1]:
        img = b"\x7fELF" + rng.randbytes(size - 4)
        images[hashlib.sha256(img).hexdigest()] = img
    compat = CompatKey(gpu_name="NVIDIA H100 80GB HBM3", compute_capability="9.0", driver="580", cuda="13.0")
    graphset = synthetic_graphset(graphs=16, nodes=200, seed=seed)
    saved = write_archive(store, graphset, identity or sample_identity(), compat, kernel_images=images,
                          alloc_log=rng.randbytes(sizes[-1]),
                          engine={"kv_cache_bytes": 1 << 30})
    return saved.manifest


def archive_shape(total_mb: float) -> list[int]:
    """Blob sizes of a realistic archive of about `total_mb` MB: table, kernel images, alloc log."""
    total = int(total_mb * 1e6)
    table = max(1 << 16, total // 50)
    images = [max(1 << 12, total // 25)] * 6
    log = max(1 << 12, total - table - sum(images))
    return [table, *images, log]
