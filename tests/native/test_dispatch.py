# ruff: noqa: E501  (embedded C-call snippets read better unwrapped)
"""The three driver entry points (driver_entry.cpp), against the stand-in driver: exported symbols, the dlsym override, and
cuGetProcAddress(_v2) dispatch by (base name, version, per-thread flag)."""

from __future__ import annotations

import os
import subprocess


def test_dispatch_probe(libember, standin) -> None:
    env = {**os.environ, "LD_PRELOAD": str(libember), "LD_LIBRARY_PATH": str(standin.dir)}
    env.pop("EMBER_MODE", None)
    proc = subprocess.run([str(standin.probe)], env=env, capture_output=True, text=True, timeout=30)
    lines = proc.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert proc.returncode == 0 and not failed, proc.stdout + proc.stderr
    assert sum(line.startswith("OK") for line in lines) >= 25


def test_probe_without_ember_sees_the_driver(standin) -> None:
    """Sanity of the probe itself: without the interposer its ember checks cannot pass."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(standin.dir)}
    env.pop("LD_PRELOAD", None)
    proc = subprocess.run([str(standin.probe)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 100 and "FAIL setup" in proc.stdout


def test_wrappers_in_save_mode_reach_region_not_driver(run_py) -> None:
    out = run_py(
        """
        import ctypes
        gpa = cuda.cuGetProcAddress_v2
        p = ctypes.c_void_p()
        assert gpa(b"cuMemAllocAsync", ctypes.byref(p), 12000, 2, None) == 0
        f = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_void_p)(p.value)
        d = ctypes.c_uint64()
        assert f(ctypes.byref(d), 4096, None) == 0
        base, size = ip.region()
        assert base <= d.value < base + size, (hex(d.value), hex(base))
        assert "cuMemAllocAsync_ptsz" not in calls()  # served by the region, not the driver
        print("ok")
        """,
        mode="save",
    )
    assert "ok" in out.stdout
