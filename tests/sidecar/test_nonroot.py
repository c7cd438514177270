"""The `ember-sidecar` process as its container runs it: UID 65532, no capabilities, no_new_privs,
`/` read-only except the run dir and its /tmp (tests/support/confine.py builds the mount namespace).
Standalone mode against a local store here; tests/k8s/test_sidecar_nonroot.py claims through the
API server and fetches from MinIO the same way."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.confine import UID, confined, open_to_all, sidecar_env, unshare_works
from support.sidecar import wait_for

from ember import handoff
from ember.store import LocalStore
from ember_testing.archives import write_blob_archive

pytestmark = pytest.mark.skipif(not unshare_works(), reason="needs root and mount namespaces (unshare)")


@pytest.fixture
def base() -> Iterator[Path]:
    """A world-traversable scratch dir (pytest's tmp_path is 0700 root: the sidecar UID could not enter)."""
    path = Path(tempfile.mkdtemp(prefix="ember-nonroot-"))
    path.chmod(0o755)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def probe_writes(run_dir: Path, tmp: Path) -> list[str]:
    """What the confined UID may write: exactly its volumes. Returns the script's report lines."""
    script = (
        "import os, sys\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        open(os.path.join(p, '.ember-write-probe'), 'w').close(); print('rw', p)\n"
        "    except OSError as e:\n"
        "        print('ro' if e.errno == 30 else 'denied', p)\n"
        "print('uid', os.getuid(), os.geteuid())\n"
    )
    targets = [str(run_dir), str(tmp), "/tmp", "/", "/etc", "/var/tmp", "/dev/shm", str(Path.cwd())]
    out = subprocess.run(confined([sys.executable, "-c", script, *targets], writable=[run_dir, tmp]),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_only_declared_volumes_are_writable(base: Path) -> None:
    run_dir, tmp = base / "run", base / "tmp"
    lines = probe_writes(run_dir, tmp)
    assert f"rw {run_dir}" in lines and f"rw {tmp}" in lines
    for path in ("/tmp", "/", "/etc", "/var/tmp", "/dev/shm", str(Path.cwd())):
        assert f"ro {path}" in lines, (path, lines)  # read-only file system, not only permissions
    assert f"uid {UID} {UID}" in lines


def test_standalone_restore_as_non_root_read_only_root(base: Path) -> None:
    store = LocalStore(base / "store")
    m = write_blob_archive(store, [4096, 300_000, 70_000])
    open_to_all(base / "store")  # the store volume: readable, not writable, by the sidecar UID
    run_dir, tmp = base / "run", base / "tmp"
    cmd = [sys.executable, "-m", "ember_sidecar.main", "--run-dir", str(run_dir), "--port", "0",
           "--host", "127.0.0.1", "--standalone", "--store", store.uri, "--identity", m.identity_hash]
    proc = subprocess.Popen(confined(cmd, writable=[run_dir, tmp]), env=sidecar_env(tmp, tmp),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (run_dir / "sidecar.port").is_file(), what="sidecar port")
        res = handoff.wait_for_archive(run_dir, deadline=30)
        assert res.restored and res.identity == m.identity_hash, res.reason
        for b in m.blobs:  # fetched and verified into the run dir, owned by the sidecar UID
            path = res.blob_path(b.sha256)
            assert path.stat().st_size == b.compressed_size and path.stat().st_uid == UID
        handoff.report("ready", 0.0, run_dir=run_dir)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "Read-only file system" not in out and "Permission denied" not in out, out
