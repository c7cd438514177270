"""CPU: an archive published by the runtime (through ember.archive.bundle) reads back intact with
the runtime's facts (image order and load options); damage and foreign keys are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings")

from ember.archive import bundle, graph_table
from ember.archive.graphs import GraphSet, KernelRef, NodeType
from ember.identity import ArchiveIdentity, CompatKey
from ember.runtime import compat, publish
from ember.store import open_store
from ember_testing.synthetic import synthetic_graphset, synthetic_images


def _archive() -> tuple[publish.ArchiveContent, object]:
    gs = synthetic_graphset(graphs=4, nodes=120, groups=2)
    used = sorted({k.image for k in gs.kernels})
    pool = synthetic_images(len(used) + 1)
    # The synthetic graph set names its own image hashes; give each used hash some bytes,
    # in an execution order that is not the sorted one.
    images = [
        publish.Image(h, data, "cubin", {"jit": {}, "library": {"1": 1}}, 2)
        for h, data in zip(reversed(used), pool.values(), strict=False)
    ]
    ident = ArchiveIdentity(
        model="ember-workload/test", engine="ember-decode", engine_version="0.1.0", capture_sizes=(1, 2, 4, 8)
    )
    key = CompatKey(
        gpu_name="NVIDIA H100 80GB HBM3", compute_capability="9.0", driver="580.159.04", cuda="13.0"
    )
    arc = publish.ArchiveContent(
        ident,
        key,
        graph_table.encode(gs),
        images,
        alloc_log=b"ember-alloclog 1\n",
        rng_state=b"\1" * 16,
        engine={"kv_cache_bytes": 1 << 20, "outputs": {}},
    )
    return arc, gs


def test_write_read_round_trip(tmp_path: Path) -> None:
    uri = tmp_path.as_uri()
    arc, gs = _archive()
    manifest_uri, digest, nbytes = publish.write(uri, arc, gs)
    assert manifest_uri.endswith(arc.identity.hash() + "/manifest") and len(digest) == 64 and nbytes > 0
    m = publish.open_archive(uri, arc.identity.hash()).manifest
    assert m.graphs.count == 4 and len(m.graphs.groups) == 2
    back = publish.read(uri, arc.identity.hash())
    assert back.graph_table == arc.graph_table and back.alloc_log == arc.alloc_log
    assert [(i.content_hash, i.data, i.options) for i in back.images] == [
        (i.content_hash, i.data, i.options) for i in arc.images
    ]  # execution order kept
    assert back.engine["kv_cache_bytes"] == 1 << 20
    assert bundle.verify_archive(uri, arc.identity.hash()) == []  # the sidecar's check agrees


def test_the_proven_table_is_published_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SAVE publishes the bytes it proved: handed on, never encoded a second time."""
    arc, gs = _archive()

    def encode(*_: object, **__: object) -> bytes:
        raise AssertionError("publishing encoded the graph table again")

    monkeypatch.setattr(graph_table, "encode", encode)
    publish.write(tmp_path.as_uri(), arc, gs)
    archive = publish.open_archive(tmp_path.as_uri(), arc.identity.hash())
    assert archive.blob_bytes(archive.manifest.graphs.table) == arc.graph_table
    assert bundle.verify_archive(tmp_path.as_uri(), arc.identity.hash()) == []


def test_damaged_blob_is_refused(tmp_path: Path) -> None:
    uri = tmp_path.as_uri()
    arc, gs = _archive()
    publish.write(uri, arc, gs)
    m = publish.open_archive(uri, arc.identity.hash()).manifest
    path = open_store(uri).blob_path(m.blob(m.alloc_log).sha256)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(publish.ArchiveError, match=r"(?i)digest|corrupt|match"):
        publish.read(uri, arc.identity.hash())


def test_missing_archive_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(publish.ArchiveError, match="no archive"):
        publish.open_archive(tmp_path.as_uri(), "0" * 64)


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


def test_execution_order_names_the_images_of_child_graphs_where_they_run() -> None:
    """SAVE publishes only the images `execution_order` names: one used only in a child graph
    must be among them (publishing refuses an archive without it)."""
    gs = synthetic_graphset(graphs=2, nodes=40, groups=1, child_graphs=True)
    # every kernel in an image of its own, so that the child's kernel (1) has one to itself
    gs = GraphSet(gs.graphs, [KernelRef(f"img-{i}", k.name) for i, k in enumerate(gs.kernels)],
                  gs.function_attrs)
    top = {n.params.kernel for g in gs.graphs for n in g.nodes if n.type == NodeType.KERNEL}
    assert 1 not in top  # the synthetic child graph's kernel runs only there
    order = publish.execution_order(gs, [1])
    assert "img-1" in order
    assert sorted(order) == sorted({f"img-{k}" for k in top | {1}})
