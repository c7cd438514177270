"""`ember ls`, `ember gc`, `ember inspect` of a missing store, and `--endpoint`, on real local
stores (archives written by the archive writer) and a closed loopback S3 endpoint."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ember.archive import bundle
from ember.archive.gc import plan_gc
from ember.cli import app
from ember.identity import ArchiveIdentity, CompatKey
from ember.store import LocalStore
from ember_testing.synthetic import synthetic_graphset, synthetic_images

A = ArchiveIdentity(model="test/a", engine="transformers", engine_version="4.57.0", capture_sizes=(1, 2, 4))
B = A.model_copy(update={"model": "test/b"})
COMPAT = CompatKey(gpu_name="NVIDIA H100", compute_capability="9.0", driver="580.1", cuda="13.0")


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    """Two archives sharing their kernel images (content-addressed), each with blobs of its own,
    plus one blob no manifest names; every blob two hours old."""
    st = LocalStore(tmp_path / "store")
    bundle.write_archive(st, synthetic_graphset(graphs=6, nodes=90, groups=2), A, COMPAT,
                         kernel_images=synthetic_images())
    bundle.write_archive(st, synthetic_graphset(graphs=2, nodes=30, groups=1), B, COMPAT,
                         kernel_images=synthetic_images())
    st.put_blob(b"orphan")
    old = time.time() - 7200
    for blob in st.iter_blobs():
        os.utime(st.blob_path(blob.digest), (old, old))
    return st


def blobs_of(st: LocalStore, identity: ArchiveIdentity) -> set[str]:
    manifest = json.loads(st.get_manifest(identity.hash()) or b"{}")
    return {b["sha256"] for b in manifest["blobs"]}


def test_missing_local_store_is_an_error_not_an_empty_store(tmp_path: Path) -> None:
    typo = (tmp_path / "typo").as_uri()
    for command in ("inspect", "ls", "verify"):
        code, out = run(command, typo)
        assert code == 1 and "no store at" in out and "typo" in out, (command, out)
    (tmp_path / "empty").mkdir()
    code, out = run("ls", (tmp_path / "empty").as_uri())
    assert code == 0 and "no archives" in out


def test_ls_lists_identity_size_and_date(store: LocalStore) -> None:
    code, out = run("ls", store.uri, "--json")
    assert code == 0
    rows = {r["identity_hash"]: r for r in json.loads(out)["archives"]}
    assert set(rows) == {A.hash(), B.hash()}
    m, _ = bundle.load_manifest_from(store, A.hash())
    assert rows[A.hash()]["bytes"] == m.total_bytes and rows[A.hash()]["model"] == "test/a"
    assert rows[A.hash()]["created_at"].startswith(m.created_at.isoformat()[:10])
    code, out = run("ls", store.uri)
    assert code == 0 and "test/b" in out and "2 archive(s)" in out


def test_gc_is_a_dry_run_unless_delete(store: LocalStore) -> None:
    before = {b.digest for b in store.iter_blobs()}
    code, out = run("gc", store.uri, "--keep-identity", A.hash(), "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["dry_run"] and plan["archives"] == [B.hash()] and plan["kept"] == [A.hash()]
    assert {b.digest for b in store.iter_blobs()} == before and store.get_manifest(B.hash()) is not None


def test_gc_deletes_what_no_kept_archive_uses(store: LocalStore) -> None:
    shared, only_b = blobs_of(store, A) & blobs_of(store, B), blobs_of(store, B) - blobs_of(store, A)
    assert shared and only_b  # the fixture's point: B shares blobs with A and has its own
    code, out = run("gc", store.uri, "--keep-identity", A.hash()[:16], "--delete")
    assert code == 0, out
    assert store.list_archives() == [A.hash()]
    left = {b.digest for b in store.iter_blobs()}
    assert left == blobs_of(store, A)  # B's own blobs and the orphan are gone, the shared ones stay
    assert bundle.verify_archive(store, A.hash(), A) == []


def test_gc_keep_file_and_young_blobs(store: LocalStore, tmp_path: Path) -> None:
    keep = tmp_path / "keep.txt"
    keep.write_text(f"# archives in use\n{store.manifest_uri(B.hash())}\n\n{A.hash()}  # also A\n")
    fresh = store.put_blob(b"being saved")  # young: a SAVE may be about to name it
    code, out = run("gc", store.uri, "--keep", str(keep), "--delete", "--json")
    assert code == 0, out
    assert json.loads(out)["archives"] == [] and json.loads(out)["young_blobs"] == 1
    assert sorted(store.list_archives()) == sorted([A.hash(), B.hash()]) and store.has_blob(fresh)
    assert {b.digest for b in store.iter_blobs()} == blobs_of(store, A) | blobs_of(store, B) | {fresh}


def test_gc_refuses_a_bad_keep_line_and_an_unreadable_manifest(store: LocalStore, tmp_path: Path) -> None:
    keep = tmp_path / "keep.txt"
    keep.write_text(f"{A.hash()}\nllama-3-8b\n")  # a name, not an identity: nothing may be deleted
    code, out = run("gc", store.uri, "--keep", str(keep), "--delete")
    assert code == 2 and "llama-3-8b" in out and len(store.list_archives()) == 2
    store.put_manifest(A.hash(), b"{ not json")
    code, out = run("gc", store.uri, "--keep-identity", A.hash(), "--delete")
    assert code == 1 and "unreadable manifest" in out and len(store.list_archives()) == 2


def test_gc_without_a_readable_cluster_deletes_nothing(store: LocalStore, tmp_path: Path) -> None:
    code, out = run("gc", store.uri, "--delete", "--kubeconfig", str(tmp_path / "nope"))
    assert code == 2 and "cannot read GraphArchives" in out and "--keep" in out
    assert len(store.list_archives()) == 2


def test_no_blob_goes_while_an_identity_is_being_saved(store: LocalStore) -> None:
    plan = plan_gc(store, {A.hash()}, min_age_s=0, saving={"cd" * 32})
    assert plan.archives == [B.hash()] and plan.blobs == [] and "being saved" in plan.held
    plan = plan_gc(store, {A.hash()}, min_age_s=0, saving={A.hash()})  # its manifest is there
    assert plan.blobs and not plan.held


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoint_option_reaches_s3_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMBER_S3_ENDPOINT", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    endpoint = f"http://127.0.0.1:{closed_port()}"
    for command in ("ls", "inspect", "gc"):
        args = [command, "s3://bucket/prefix", "--endpoint", endpoint] + (["--keep-identity", A.hash()]
                                                                           if command == "gc" else [])
        code, out = run(*args)
        assert code == 2 and "unavailable" in out and endpoint in out, (command, out)


def test_every_store_command_takes_endpoint() -> None:
    for command in ("inspect", "verify", "ls", "gc", "save", "load"):
        code, out = run(command, "--help")
        assert code == 0 and "--endpoint" in out, command


def test_save_and_load_pass_endpoint_to_the_process_they_re_execute(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.cli import decode as commands

    monkeypatch.setenv("EMBER_S3_ENDPOINT", "")  # restored (to unset, if it was) after the test
    monkeypatch.delenv("EMBER_S3_ENDPOINT")
    assert commands._use_endpoint("") == "" and "EMBER_S3_ENDPOINT" not in os.environ
    assert commands._use_endpoint("http://127.0.0.1:9") == "http://127.0.0.1:9"
    assert os.environ["EMBER_S3_ENDPOINT"] == "http://127.0.0.1:9"
