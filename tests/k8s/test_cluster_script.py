"""e2e/cluster.sh's daemons hold no descriptor of whoever started them.

A component started under a caller's lock (`flock FILE e2e/cluster.sh ...`, as the test commands
in tests/k8s do) must not inherit that lock: the cluster outlives the caller, and an inherited
descriptor keeps the lock held until `cluster.sh down`, blocking the next `flock FILE` for as
long as the cluster runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from support.cluster import CLUSTER_SH, LocalCluster

pytestmark = [pytest.mark.k8s]


def _open_files(pid: int) -> list[str]:
    targets = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        if fd.name in ("0", "1", "2"):
            continue
        try:
            targets.append(os.readlink(fd))
        except FileNotFoundError:  # closed by the daemon while we listed them
            continue
    return targets


def test_a_component_restarted_under_a_callers_lock_does_not_hold_it(k8s: LocalCluster,
                                                                     tmp_path: Path) -> None:
    lock = tmp_path / "caller.lock"
    proc = subprocess.run(["flock", str(lock), str(CLUSTER_SH), "restart", "kwok"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    work = Path(os.environ.get("EMBER_E2E_WORK", CLUSTER_SH.parent / ".work"))
    pid = int((work / "run" / "pids" / "kwok.pid").read_text())
    held = [f for f in _open_files(pid) if f.endswith(".lock")]
    assert held == []
    # ... so the lock is free while kwok keeps running
    free = subprocess.run(["flock", "-n", str(lock), "true"], timeout=10)
    assert free.returncode == 0 and Path(f"/proc/{pid}").exists()


def test_a_component_slow_to_exec_is_waited_for_not_called_exited(k8s: LocalCluster) -> None:
    """The started process is bash, then setsid, before it is the component: on a loaded machine
    the first readiness poll can see it as neither. Thousands of inherited descriptors (each closed
    in the subshell before exec) stretch that window; `up` must still wait for the component.
    MinIO, because its start is awaited like the apiserver's, and restarting the apiserver would
    leave the controller-manager's watches backing off for tens of seconds into the next tests."""
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(3000)]
    try:
        proc = subprocess.run([str(CLUSTER_SH), "restart", "minio"], capture_output=True, text=True,
                              timeout=300, pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)
    assert proc.returncode == 0, proc.stderr
    assert "exited while waiting" not in proc.stderr
    assert subprocess.run([str(CLUSTER_SH), "status"], capture_output=True, timeout=60).returncode == 0
