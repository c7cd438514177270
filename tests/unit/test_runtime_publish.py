"""CPU: an archive written by the runtime reads back intact; damage and foreign keys are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings")

from ember.archive import format as fmt
from ember.archive.synthetic import synthetic_graphset, synthetic_images
from ember.identity import ArchiveIdentity, CompatKey
from ember.runtime import compat, publish
from ember.store import open_store


def _archive() -> publish.Archive:
    gs = synthetic_graphset(graphs=4, nodes=120, groups=2)
    images = [
        publish.Image(h, data, "cubin", {"jit": {}, "library": {"1": 1}}, 2)
        for h, data in synthetic_images(2).items()
    ]
    ident = ArchiveIdentity(
        model="ember-workload/test", engine="ember-decode", engine_version="0.1.0", capture_sizes=(1, 2, 4, 8)
    )
    key = CompatKey(
        gpu_name="NVIDIA H100 80GB HBM3", compute_capability="9.0", driver="580.159.04", cuda="13.0"
    )
    return publish.Archive(
        ident,
        key,
        fmt.encode(gs),
        images,
        alloc_log=b"ember-alloclog 1\n",
        rng_state=b"\1" * 16,
        engine={"kv_cache_bytes": 1 << 20, "outputs": {}},
    )


def test_write_read_round_trip(tmp_path: Path) -> None:
    uri = tmp_path.as_uri()
    arc = _archive()
    manifest_uri, digest, nbytes = publish.write(uri, arc)
    assert manifest_uri.endswith(arc.identity.hash() + "/manifest") and len(digest) == 64 and nbytes > 0
    m = publish.read_manifest(uri, arc.identity.hash())
    assert m.graphs.count == 4 and len(m.graphs.groups) == 2
    back = publish.read(uri, m)
    assert back.graph_table == arc.graph_table and back.alloc_log == arc.alloc_log
    assert [(i.content_hash, i.data, i.options) for i in back.images] == [
        (i.content_hash, i.data, i.options) for i in arc.images
    ]
    assert back.engine["kv_cache_bytes"] == 1 << 20


def test_damaged_blob_is_refused(tmp_path: Path) -> None:
    uri = tmp_path.as_uri()
    arc = _archive()
    publish.write(uri, arc)
    m = publish.read_manifest(uri, arc.identity.hash())
    path = open_store(uri).blob_path(m.blob(publish.ALLOC_LOG).sha256)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(Exception, match=r"(?i)digest|corrupt|mismatch"):
        publish.read(uri, m)


def test_missing_archive_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(publish.ArchiveError, match="no archive"):
        publish.read_manifest(tmp_path.as_uri(), "0" * 64)


def test_compat_mismatch_names_each_difference() -> None:
    a = CompatKey(
        gpu_name="NVIDIA H100",
        compute_capability="9.0",
        driver="580",
        cuda="13.0",
        torch="2.11.0",
        env={"CUDA_MODULE_LOADING": "LAZY"},
    )
    b = a.model_copy(update={"driver": "581", "env": {}})
    problems = compat.check_compat(a, b)
    assert len(problems) == 2 and any("driver" in p for p in problems) and any("env" in p for p in problems)
    assert compat.check_compat(a, a) == []
