"""Whole archives through a local store: round trip, damaged archives refused clearly, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ember.archive import bundle
from ember.archive import manifest as mf
from ember.cli import app
from ember.identity import ArchiveIdentity, CompatKey, Parallelism
from ember.store import LocalStore
from ember_sidecar.fetching import ArchiveCache
from ember_testing.synthetic import synthetic_graphset, synthetic_images

IDENTITY = ArchiveIdentity(model="test/llama-3-8b-shape", engine="transformers", engine_version="4.57.0",
                           capture_sizes=(1, 2, 3, 4, 5, 6), parallelism=Parallelism(expert=2))
COMPAT = CompatKey(gpu_name="NVIDIA H200", compute_capability="9.0", driver="580.159.04", cuda="13.0",
                   torch="2.11.0", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


Saved = tuple[LocalStore, bundle.PublishedArchive]


@pytest.fixture
def saved(tmp_path: Path) -> tuple[LocalStore, bundle.PublishedArchive]:
    store = LocalStore(tmp_path / "store")
    gs = synthetic_graphset(graphs=6, nodes=90, groups=2)
    result = bundle.write_archive(store, gs, IDENTITY, COMPAT, kernel_images=synthetic_images(),
                                  engine={"kv_cache_bytes": 8 << 30, "num_blocks": 4096},
                                  alloc_log=b"A" * 5000, rng_state=b"philox-seed-offset")
    return store, result


def blob_file(store: LocalStore, result: bundle.PublishedArchive, name: str) -> Path:
    return store.blob_path(result.manifest.blob(name).sha256)


def test_round_trip_through_a_local_store(saved: Saved) -> None:
    store, result = saved
    gs = synthetic_graphset(graphs=6, nodes=90, groups=2)
    archive = bundle.read_archive(store, IDENTITY.hash(), expected_identity=IDENTITY)
    assert archive.graph_table.to_graphset().graphs == gs.graphs
    assert archive.alloc_log == b"A" * 5000
    assert archive.rng_state == b"philox-seed-offset"
    assert archive.manifest.engine == {"kv_cache_bytes": 8 << 30, "num_blocks": 4096}
    assert archive.manifest.compat == COMPAT
    for content_hash, image in synthetic_images().items():
        assert archive.kernel_image(content_hash) == image
    m = archive.manifest
    assert m.graphs.count == 6 and m.graphs.keys == [[k] for k in range(1, 7)]
    assert [g.keys for g in m.graphs.groups] == [[[1], [2], [3]], [[4], [5], [6]]]
    assert {i.kind for i in m.kernel_images} == {"cubin"}
    # Manifest written last, digest in the summary is the stored manifest's.
    raw = store.get_manifest(IDENTITY.hash())
    assert raw is not None
    assert result.manifest_digest == __import__("hashlib").sha256(raw).hexdigest()
    assert result.manifest.graphs.count == 6 and result.bytes == m.total_bytes + len(raw)
    assert result.manifest_uri.endswith(f"/archives/{IDENTITY.hash()}/manifest")
    assert bundle.verify_archive(store, IDENTITY.hash(), IDENTITY) == []


def test_images_and_tables_are_shared_between_archives(saved: Saved) -> None:
    store, _ = saved
    other = IDENTITY.model_copy(update={"dtype": "float16"})
    result = bundle.write_archive(store, synthetic_graphset(graphs=6, nodes=90, groups=2), other, COMPAT,
                                  kernel_images=synthetic_images())
    assert result.uploaded_bytes == len(store.get_manifest(other.hash()) or b"")  # every blob was there
    assert sorted(store.list_archives()) == sorted([IDENTITY.hash(), other.hash()])


def test_missing_kernel_image_refuses_to_save(tmp_path: Path) -> None:
    images = synthetic_images()
    images.pop(next(iter(images)))
    with pytest.raises(bundle.ArchiveError, match="kernel image"):
        bundle.write_archive(LocalStore(tmp_path), synthetic_graphset(graphs=2, nodes=30, groups=1), IDENTITY,
                             COMPAT, kernel_images=images)
    assert LocalStore(tmp_path).list_archives() == []  # nothing published


def test_truncated_blob_is_reported_as_truncated(saved: Saved) -> None:
    store, result = saved
    path = blob_file(store, result, "graphs")
    path.write_bytes(path.read_bytes()[:-100])
    problems = bundle.verify_archive(store, IDENTITY.hash())
    assert any("'graphs'" in p and "truncated" in p for p in problems), problems
    with pytest.raises(bundle.ArchiveCorrupt, match="truncated"):
        bundle.read_archive(store, IDENTITY.hash())


def test_bit_flip_is_a_digest_mismatch(saved: Saved) -> None:
    store, result = saved
    name = result.manifest.kernel_images[0].blob
    path = blob_file(store, result, name)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    problems = bundle.verify_archive(store, IDENTITY.hash())
    assert len(problems) == 1 and name in problems[0] and "corrupt" in problems[0], problems
    archive = bundle.open_archive(store, IDENTITY.hash())
    with pytest.raises(bundle.ArchiveCorrupt, match="hash to"):
        archive.kernel_image(result.manifest.kernel_images[0].content_hash)


def test_missing_blob_is_named(saved: Saved) -> None:
    store, result = saved
    blob_file(store, result, "alloc-log").unlink()
    problems = bundle.verify_archive(store, IDENTITY.hash())
    assert any("'alloc-log'" in p and "missing" in p for p in problems), problems


def test_wrong_digest_in_manifest_is_refused(saved: Saved) -> None:
    store, _ = saved
    raw = json.loads(store.get_manifest(IDENTITY.hash()) or b"")
    good = raw["blobs"][0]["sha256"]
    raw["blobs"][0]["sha256"] = raw["blobs"][1]["sha256"]  # points at another (existing) blob
    store.put_manifest(IDENTITY.hash(), json.dumps(raw).encode())
    problems = bundle.verify_archive(store, IDENTITY.hash())
    assert problems and any("'graphs'" in p for p in problems), problems
    assert good not in " ".join(problems)


def test_unknown_major_version_is_refused_and_newer_minor_read(saved: Saved) -> None:
    store, _ = saved
    raw = json.loads(store.get_manifest(IDENTITY.hash()) or b"")
    newer_minor = dict(raw, format_version=f"{mf.MANIFEST_MAJOR}.{mf.MANIFEST_MINOR + 4}",
                       some_future_field={"x": 1})
    newer_minor["graphs"] = dict(raw["graphs"], future_summary=[1, 2])
    store.put_manifest(IDENTITY.hash(), json.dumps(newer_minor).encode())
    assert bundle.verify_archive(store, IDENTITY.hash()) == []

    store.put_manifest(IDENTITY.hash(), json.dumps(dict(raw, format_version="2.0")).encode())
    with pytest.raises(bundle.ArchiveVersionError, match=r"format 2\.0.*upgrade ember"):
        bundle.open_archive(store, IDENTITY.hash())
    assert "upgrade ember" in bundle.verify_archive(store, IDENTITY.hash())[0]


def test_graph_table_of_another_major_version_is_refused(saved: Saved) -> None:
    store, result = saved
    path = blob_file(store, result, "graphs")
    data = bytearray(path.read_bytes())
    data[4] = 9  # major version field of the graph table header
    digest = store.put_blob(bytes(data))
    raw = json.loads(store.get_manifest(IDENTITY.hash()) or b"")
    raw["blobs"][0].update(sha256=digest, raw_sha256=None)
    store.put_manifest(IDENTITY.hash(), json.dumps(raw).encode())
    with pytest.raises(bundle.ArchiveVersionError, match=r"graph table format 9\.\d+ "):
        _ = bundle.open_archive(store, IDENTITY.hash()).graph_table


def test_wrong_identity_is_refused(saved: Saved) -> None:
    store, _ = saved
    other = IDENTITY.model_copy(update={"max_batch": 256})
    with pytest.raises(bundle.ArchiveIdentityMismatch, match="another deployment"):
        bundle.open_archive(store, IDENTITY.hash(), expected_identity=other)
    # A manifest filed under a hash that is not its identity's.
    data = store.get_manifest(IDENTITY.hash()) or b""
    store.put_manifest(other.hash(), data)
    with pytest.raises(bundle.ArchiveIdentityMismatch, match="holds identity"):
        bundle.open_archive(store, other.hash())
    # A manifest whose recorded hash does not match its identity fields.
    raw = json.loads(data)
    raw["identity"]["max_batch"] = 7
    store.put_manifest(IDENTITY.hash(), json.dumps(raw).encode())
    assert "hashes to" in bundle.verify_archive(store, IDENTITY.hash())[0]


def test_missing_and_unparseable_manifests(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    with pytest.raises(bundle.ArchiveMissing, match="never saved"):
        bundle.open_archive(store, "ab" * 32)
    store.put_manifest("ab" * 32, b"{not json")
    with pytest.raises(bundle.ArchiveCorrupt, match="not valid JSON"):
        bundle.open_archive(store, "ab" * 32)
    store.put_manifest("ab" * 32, b'{"kind": "something-else"}')
    with pytest.raises(bundle.ArchiveCorrupt, match="not an ember manifest"):
        bundle.open_archive(store, "ab" * 32)


def test_cli_inspect_and_verify(saved: Saved) -> None:
    store, result = saved
    runner = CliRunner()
    out = runner.invoke(app, ["inspect", store.uri, "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["manifest"]["identity_hash"] == IDENTITY.hash()
    assert [g["key"] for g in report["graphs"]] == [[k] for k in range(1, 7)]
    assert report["manifest"]["graphs"]["node_types"]["KERNEL"] > 0
    # synthetic groups differ in node count: inspect says so for the second group
    assert report["groups_apart"][0] == "" and "node/edge counts" in report["groups_apart"][1]

    args = ["inspect", str(store.root), IDENTITY.hash(), "--graphs"]
    out = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    for text in ("topology groups", "kernel images", "NVIDIA H200", "kv_cache_bytes", "EVENT_RECORD",
                 "apart from the group above"):
        assert text in out.output

    ok = runner.invoke(app, ["verify", store.uri, IDENTITY.hash(), "--expect-identity", IDENTITY.hash()])
    assert ok.exit_code == 0 and "archive OK" in ok.output
    wrong = runner.invoke(app, ["verify", store.uri, "--expect-identity", "cd" * 32, "--json"])
    assert wrong.exit_code == 1 and json.loads(wrong.output)["ok"] is False

    blob_file(store, result, "graphs").write_bytes(b"garbage")
    bad = runner.invoke(app, ["verify", store.uri])
    assert bad.exit_code == 1
    assert "truncated" in bad.output


def test_cli_verify_replay_runs_the_gpu_check_only_on_an_intact_archive(
    saved: Saved, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`verify --replay` (composed in ember/cli/__init__.py): re-exec under libember first, integrity
    checks, then the runtime's replay, whose verdict becomes the exit code and the problems."""
    import ember.cli

    store, result = saved
    calls: list[str] = []
    verdict: dict[str, object] = {"ok": True, "graphs": 6, "identical": 6, "differ": []}

    def replay_verify(store_uri: str, identity_hash: str) -> dict[str, object]:
        calls.append(f"replay {identity_hash}")
        return verdict

    monkeypatch.setattr(ember.cli, "_has_torch", lambda: True)
    monkeypatch.setattr(ember.cli, "_reexec_for_replay", lambda: calls.append("reexec"))
    monkeypatch.setattr(ember.cli, "replay_verify", replay_verify)
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", store.uri, "--replay"])
    assert ok.exit_code == 0 and "archive OK" in ok.output, ok.output
    assert calls == ["reexec", f"replay {IDENTITY.hash()}"]

    verdict = {"ok": False, "graphs": 6, "identical": 5, "differ": [[3]]}
    differ = runner.invoke(app, ["verify", store.uri, "--replay", "--json"])
    assert differ.exit_code == 1
    assert json.loads(differ.output)["problems"] == [
        "1 of 6 graph(s) replayed differently from SAVE (first keys: [[3]])"]
    verdict = {"ok": False, "refused": "compat: another GPU"}
    refused = runner.invoke(app, ["verify", store.uri, "--replay", "--json"])
    assert json.loads(refused.output)["problems"] == [
        "LOAD refused the archive on this machine: compat: another GPU"]

    calls.clear()
    blob_file(store, result, "graphs").write_bytes(b"garbage")
    bad = runner.invoke(app, ["verify", store.uri, "--replay"])
    assert bad.exit_code == 1 and calls == ["reexec"]  # a damaged archive is never replayed


def test_cli_verify_replay_without_torch_says_what_it_needs(saved: Saved, monkeypatch: pytest.MonkeyPatch,
                                                            ) -> None:
    import ember.cli

    monkeypatch.setattr(ember.cli, "_has_torch", lambda: False)
    out = CliRunner().invoke(app, ["verify", saved[0].uri, "--replay"])
    assert out.exit_code == 2 and "needs torch" in out.output, out.output


def test_cli_takes_hash_prefixes_and_verifies_every_archive_of_a_store(saved: Saved, tmp_path: Path) -> None:
    store, _ = saved
    runner = CliRunner()
    full = IDENTITY.hash()
    for prefix in (full[:8], full[:12], full[:16]):
        out = runner.invoke(app, ["inspect", store.uri, prefix, "--json"])
        assert out.exit_code == 0 and json.loads(out.output)["manifest"]["identity_hash"] == full, out.output
        assert runner.invoke(app, ["verify", store.uri, prefix]).exit_code == 0
    short = runner.invoke(app, ["verify", store.uri, full[:6]], env={"COLUMNS": "200"})
    assert short.exit_code == 1 and "at least 8 hex" in short.output
    # A second archive in the store: `verify <store>` checks both, a line each.
    other = IDENTITY.model_copy(update={"dtype": "float16"})
    bundle.write_archive(store, synthetic_graphset(graphs=2, nodes=10, groups=1), other, COMPAT,
                         kernel_images=synthetic_images())
    both = runner.invoke(app, ["verify", store.uri], env={"COLUMNS": "200"})
    assert both.exit_code == 0, both.output
    assert f"{full}  OK" in both.output and f"{other.hash()}  OK" in both.output
    assert "2 of 2 archive(s) OK" in both.output



def test_cli_lists_archives_when_several(saved: Saved) -> None:
    store, _ = saved
    other = IDENTITY.model_copy(update={"dtype": "float16"})
    bundle.write_archive(store, synthetic_graphset(graphs=2, nodes=30, groups=1), other, COMPAT,
                         kernel_images=synthetic_images())
    out = CliRunner().invoke(app, ["inspect", store.uri, "--json"])
    assert out.exit_code == 0
    assert {a["identity_hash"] for a in json.loads(out.output)["archives"]} == {IDENTITY.hash(), other.hash()}


def test_attachments_travel_with_the_archive_verified_and_read_only_on_demand(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    payload = bytes(range(256)) * 400
    bundle.write_archive(store, synthetic_graphset(graphs=4, nodes=40, groups=2), IDENTITY, COMPAT,
                         kernel_images=synthetic_images(), attachments={"engine-cache.tar": payload})
    archive = bundle.open_archive(store, IDENTITY.hash())
    assert archive.manifest.attachments == ["attachment/engine-cache.tar"]
    archive.load_all()  # what LOAD's background thread reads: not the attachment
    assert "attachment/engine-cache.tar" not in archive._blobs
    assert archive.attachment("engine-cache.tar") == payload
    assert archive.attachment("other") is None

    # The sidecar's fetch copies it; a damaged copy is found by verify and refused on read.
    sidecar = ArchiveCache(tmp_path / "cache")
    sidecar.fetch(store.manifest_uri(IDENTITY.hash()), IDENTITY.hash())
    cache = sidecar.local
    fetched = bundle.open_archive(cache, IDENTITY.hash())
    assert fetched.attachment("engine-cache.tar") == payload
    entry = fetched.manifest.blob("attachment/engine-cache.tar")
    path = cache.blob_path(entry.sha256)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = bundle.verify_archive(cache, IDENTITY.hash())
    assert len(problems) == 1 and "attachment/engine-cache.tar" in problems[0]
    with pytest.raises(bundle.ArchiveCorrupt, match="engine-cache"):
        bundle.open_archive(cache, IDENTITY.hash()).attachment("engine-cache.tar")
