"""Loading libember into a process that makes no CUDA call changes nothing (issue 3): same
output, same exit status, no driver loaded, in every mode, also with no driver installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

WORK = r"""
import ctypes, hashlib, json, threading, zlib
libc = ctypes.CDLL(None)
out = {"sha": hashlib.sha256(b"ember" * 1000).hexdigest(), "crc": zlib.crc32(b"x" * 4096),
       "strlen": libc.strlen(b"hello"), "has_printf": bool(libc.printf)}
res = []
ts = [threading.Thread(target=lambda i=i: res.append(i * i)) for i in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
out["threads"] = sorted(res)
out["libcuda_loaded"] = "libcuda" in open("/proc/self/maps").read()
out["ember_loaded"] = "libember" in open("/proc/self/maps").read()
print(json.dumps(out, sort_keys=True))
"""


def _run(env_extra: dict[str, str], standin_dir: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_") and k != "LD_PRELOAD"}
    if standin_dir:
        env["LD_LIBRARY_PATH"] = standin_dir
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", WORK], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("mode", [None, "off", "save", "load"])
def test_preloaded_library_changes_nothing_without_cuda_calls(libember, standin, mode) -> None:
    base = _run({}, str(standin.dir))
    extra = {"LD_PRELOAD": str(libember)}
    if mode:
        extra["EMBER_MODE"] = mode
    with_ember = _run(extra, str(standin.dir))
    assert base.returncode == with_ember.returncode == 0, with_ember.stderr
    a = base.stdout.replace('"ember_loaded": false', "")
    assert a == with_ember.stdout.replace('"ember_loaded": true', "")
    assert '"libcuda_loaded": false' in with_ember.stdout  # the driver is dlopened lazily, on first use
    assert with_ember.stderr == ""                          # nothing logged at the default level


def test_shell_tools_run_unchanged(libember) -> None:
    env = {**os.environ, "LD_PRELOAD": str(libember), "EMBER_MODE": "save"}
    for cmd in (["sh", "-c", "echo ember && true"], ["ls", "/"]):
        plain = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        hooked = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
        assert (plain.returncode, plain.stdout) == (hooked.returncode, hooked.stdout)


def test_control_api_without_a_driver_reports_it(libember, tmp_path) -> None:
    """No libcuda anywhere: the control API answers with EMBER_ENODRIVER, nothing crashes."""
    code = (
        "from ember.native import Interposer, EmberError\n"
        "ip = Interposer.attach()\n"
        "try:\n    ip.arm()\nexcept EmberError as e:\n    print('arm', e.code)\n"
        "print('mode', ip.mode, 'catalog', ip.catalog())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env.update({"LD_PRELOAD": str(libember), "EMBER_MODE": "save", "LD_LIBRARY_PATH": str(tmp_path),
                "EMBER_LIB": str(libember)})
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    if "arm -9" not in proc.stdout:
        pytest.skip("a real CUDA driver is installed here")
    assert "mode save catalog []" in proc.stdout
