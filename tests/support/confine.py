"""Run a process the way the sidecar container runs: a non-root UID, `/` read-only except its volumes.

`confined(cmd, writable=[...])` wraps a command in a private mount namespace (`unshare --mount`)
where, before the command starts (as root):
- every mount except /proc, /sys, /dev and /dev/pts is remounted read-only: `/`, /tmp,
  /dev/shm, everything else;
- the `writable` directories are bind-mounted onto themselves first, so they stay writable (the
  pod's emptyDirs: the run dir, /tmp);
- /root (mode 0700 here, the interpreter lives in /root/.pyenv) is replaced by a read-only tmpfs
  holding only a read-only bind of /root/.pyenv, so the unprivileged UID can start Python and
  nothing else of root's home is visible;
then `setpriv` drops to UID/GID `uid` with no supplementary groups, no_new_privs set and every
capability dropped (bounding, inheritable, ambient), and execs the command.

Requires root and a kernel that allows unprivileged mount namespaces for root (`unshare_works`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

UID = 65532  # the distroless "nonroot" UID; unused on the test machines
# Kernel filesystems and device nodes stay as they are (a container has its own); /dev/shm does not.
_KEEP_RW = ("/proc", "/proc/*", "/sys", "/sys/*", "/dev", "/dev/pts")


def unshare_works() -> bool:
    """Whether this machine lets the tests build the confined mount namespace."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -o remount,bind,ro / && "
         "! touch /.ember-ro-probe 2>/dev/null"], capture_output=True, timeout=30)
    return probe.returncode == 0


def _setup_script(writable: list[Path], uid: int, cmd: list[str]) -> str:
    q = shlex.quote
    stage = q(str(writable[0] / ".pyenv-stage"))
    lines = ["set -eu"]
    pyenv = Path(sys.base_prefix).resolve()
    if str(pyenv).startswith("/root/"):
        top = Path("/root") / pyenv.relative_to("/root").parts[0]  # /root/.pyenv
        lines += [f"mkdir -p {stage}", f"mount --bind {q(str(top))} {stage}",
                  "mount -t tmpfs -o mode=0755,size=1m ember-root /root",
                  f"mkdir -p {q(str(top))}", f"mount --move {stage} {q(str(top))}",
                  f"mount -o remount,bind,ro {q(str(top))}", f"rmdir {stage}"]
    lines += [f"mount --bind {q(str(d))} {q(str(d))}" for d in writable]
    keep = " ".join(q(str(d)) for d in writable)
    # Remount every other mount read-only (deepest last is not needed: remount is per mount).
    lines.append(
        "awk '{print $2}' /proc/self/mounts | sort -u | while read -r m; do "
        f"case \"$m\" in {'|'.join(_KEEP_RW)}) continue;; esac; "
        f"for w in {keep}; do [ \"$m\" = \"$w\" ] && continue 2; done; "
        "mount -o remount,bind,ro \"$m\" 2>/dev/null || true; done"
    )
    lines.append(
        f"exec setpriv --reuid={uid} --regid={uid} --clear-groups --no-new-privs "
        "--inh-caps=-all --ambient-caps=-all --bounding-set=-all -- " + " ".join(q(c) for c in cmd)
    )
    return "\n".join(lines)


def confined(cmd: list[str], writable: list[Path], uid: int = UID) -> list[str]:
    """`cmd` wrapped to run as `uid` with only `writable` writable (see the module docstring)."""
    for d in writable:
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, uid, uid)
        d.chmod(0o755)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _setup_script(writable, uid, cmd)]


def open_to_all(path: Path) -> None:
    """Make `path` (a directory whose parents are traversable) and everything in it readable by any UID."""
    path.chmod(0o755)
    for root, dirs, files in os.walk(path):
        for d in dirs:
            Path(root, d).chmod(0o755)
        for f in files:
            Path(root, f).chmod(0o644)


def sidecar_env(home: Path, tmp: Path, **extra: str) -> dict[str, str]:
    """The sidecar's environment: HOME and TMPDIR on its writable volume, no bytecode writes."""
    # INFO: at DEBUG botocore's logging fills an undrained stdout pipe and blocks the sidecar.
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp), "PYTHONDONTWRITEBYTECODE": "1",
           "EMBER_LOG_LEVEL": "INFO", **extra}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return env
