"""Fixtures for the native tier: libember (built with CMake if no build is found), the stand-in
driver `libcuda.so.1` and the dispatch probe (compiled with the system C compiler), and a helper
that runs a Python snippet in a fresh process with libember preloaded against the stand-in."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from ember import native

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "standin"


def cuda_include() -> Path:
    """cuda.h from EMBER_CUDA_INCLUDE, a CUDA toolkit, or the nvidia-cuda-runtime wheel."""
    if env := os.environ.get("EMBER_CUDA_INCLUDE"):
        return Path(env)
    for p in sys.path:
        hits = sorted(Path(p).glob("nvidia/*/include/cudaTypedefs.h"), reverse=True)
        if hits:
            return hits[0].parent
    for cand in (Path("/usr/local/cuda/include"), Path("/usr/include")):
        if (cand / "cudaTypedefs.h").is_file():
            return cand
    pytest.skip("no cuda.h: pip install nvidia-cuda-runtime")


def _build_library(out: Path) -> Path:
    subprocess.run(["cmake", "-S", str(ROOT / "native"), "-B", str(out), "-DCMAKE_BUILD_TYPE=RelWithDebInfo"],
                   check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(out), "-j2"], check=True, capture_output=True)
    return out / "libember.so"


@pytest.fixture(scope="session")
def libember(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built library: EMBER_LIB / an existing build, else a fresh CMake build."""
    found = native.find_library()
    if found is not None:
        return found
    return _build_library(tmp_path_factory.mktemp("native-build"))


@dataclass
class Standin:
    dir: Path          # holds libcuda.so.1 (put it on LD_LIBRARY_PATH)
    probe: Path        # the dispatch probe executable


@pytest.fixture(scope="session")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Standin:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    inc = cuda_include()
    out = tmp_path_factory.mktemp("standin")
    subprocess.run([cc, "-O1", "-g", "-shared", "-fPIC", "-fvisibility=hidden", "-Wl,-Bsymbolic",
                    "-Wl,-soname,libcuda.so.1", f"-I{inc}", str(STANDIN / "standin_cuda.c"),
                    "-o", str(out / "libcuda.so.1"), "-ldl", "-lpthread"], check=True)
    subprocess.run([cc, "-O1", "-g", f"-I{inc}", str(STANDIN / "dispatch_probe.c"), "-o", str(out / "probe"),
                    f"-L{out}", "-l:libcuda.so.1", "-ldl"], check=True)
    return Standin(out, out / "probe")


@pytest.fixture(scope="session")
def bindings_standin(tmp_path_factory: pytest.TempPathFactory) -> Standin:
    """The stand-in rebuilt with what cuda.bindings needs (standin/bindings_shim.c: a
    cuGetProcAddress that falls back to its own exports, device queries, events, launches). A
    module that restores archives through cuda.bindings overrides `standin` with it."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("standin-bindings")
    subprocess.run([cc, "-O1", "-g", "-shared", "-fPIC", "-fvisibility=hidden", "-Wl,-Bsymbolic",
                    "-Wl,-soname,libcuda.so.1", f"-I{cuda_include()}", f"-I{STANDIN}",
                    str(STANDIN / "bindings_shim.c"), "-o", str(out / "libcuda.so.1"), "-ldl", "-lpthread"],
                   check=True)
    return Standin(out, out / "no-probe")


# What compat.current() reads of torch, nothing more (torch is not installed in CI), and the
# driver binding: for snippets that restore archives (`restore_py`).
RESTORE_PRELUDE = """
import types
torch = types.ModuleType("torch")
torch.__version__ = "0.0+standin"
torch.version = types.SimpleNamespace(cuda="13.0")
sys.modules["torch"] = torch
from cuda.bindings import driver as cu
"""


@pytest.fixture
def run_py(libember: Path, standin: Standin):
    """Runs a Python snippet with libember preloaded against the stand-in driver.

    The snippet gets `cuda` (ctypes handle of libcuda.so.1: hooked names resolve to ember's
    wrappers through the dlsym door), `ip` (an attached Interposer) and helpers `alloc`, `free`.
    """
    return _runner(libember, standin)


@pytest.fixture
def restore_py(libember: Path, bindings_standin: Standin):
    """`run_py` for snippets that restore archives through cuda.bindings: the stand-in with what
    the binding needs, a stand-in `torch` module and `cu` (cuda.bindings.driver) in the snippet."""
    return _runner(libember, bindings_standin, RESTORE_PRELUDE)


def _runner(libember: Path, standin: Standin, extra: str = ""):
    prelude = textwrap.dedent(
        """
        import ctypes, json, os, sys
        from ember.native import Interposer, EmberError, EmberDivergence
        cuda = ctypes.CDLL("libcuda.so.1")
        for name in ("standin_calls",):
            getattr(cuda, name).restype = ctypes.c_char_p
        def calls():
            return cuda.standin_calls().decode().split()
        if os.environ.get("TEST_NO_INIT") != "1":
            assert cuda.cuInit(0) == 0
        ip = Interposer.attach()
        def alloc(n):
            p = ctypes.c_uint64()
            rc = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n))
            assert rc == 0, rc
            return p.value
        def free(p):
            rc = cuda.cuMemFree_v2(ctypes.c_uint64(p))
            assert rc == 0, rc
        def reserve(n, align=0, hint=0):
            p = ctypes.c_uint64()
            rc = cuda.cuMemAddressReserve(ctypes.byref(p), ctypes.c_size_t(n), ctypes.c_size_t(align),
                                          ctypes.c_uint64(hint), ctypes.c_ulonglong(0))
            assert rc == 0, rc
            return p.value
        """
    )

    def run(code: str, *, mode: str | None = None, env: dict[str, str] | None = None,
            check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        e = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
        e.update({
            "LD_PRELOAD": str(libember),
            "LD_LIBRARY_PATH": f"{standin.dir}:{e.get('LD_LIBRARY_PATH', '')}",
            "EMBER_LIB": str(libember),
            "PYTHONPATH": f"{ROOT}:{e.get('PYTHONPATH', '')}",
        })
        if mode:
            e["EMBER_MODE"] = mode
        e.update(env or {})
        source = prelude + extra + textwrap.dedent(code)
        proc = subprocess.run([sys.executable, "-c", source], env=e, text=True, capture_output=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"snippet failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    return run
