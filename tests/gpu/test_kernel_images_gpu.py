"""Cut kernel images on a real GPU: the driver loads them, and their kernels compute what the
whole image's do (`pytest -m gpu tests/gpu/test_kernel_images_gpu.py`; needs nvcc to build the
fixture, tests/data/kernel_images/build.sh).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from ember.archive import kernel_images

pytestmark = pytest.mark.gpu
DATA = Path(__file__).resolve().parents[1] / "data" / "kernel_images"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("nvcc") is None or shutil.which("cuobjdump") is None:
        pytest.skip("the CUDA toolkit (nvcc, cuobjdump) builds the fixture")
    out = tmp_path_factory.mktemp("kernel_images")
    subprocess.run(["bash", str(DATA / "build.sh"), str(out)], check=True, capture_output=True)
    return out


class Driver:
    def __init__(self) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.ok(self.cu.cuInit(0))
        dev, self.ctx = ctypes.c_int(), ctypes.c_void_p()
        self.ok(self.cu.cuDeviceGet(ctypes.byref(dev), 0))
        self.ok(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev))
        self.ok(self.cu.cuCtxSetCurrent(self.ctx))
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.ok(self.cu.cuDeviceGetAttribute(ctypes.byref(major), 75, dev))
        self.ok(self.cu.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev))
        self.arch = major.value * 10 + minor.value

    @staticmethod
    def ok(rc: int) -> None:
        assert rc == 0, f"CUresult {rc}"

    def load(self, image: bytes) -> ctypes.c_void_p:
        lib, buf = ctypes.c_void_p(), ctypes.create_string_buffer(image, len(image))
        self.ok(self.cu.cuLibraryLoadData(ctypes.byref(lib), buf, None, None, 0, None, None, 0))
        return lib

    def kernel(self, lib: ctypes.c_void_p, name: str) -> ctypes.c_void_p | None:
        k, f = ctypes.c_void_p(), ctypes.c_void_p()
        rc = self.cu.cuLibraryGetKernel(ctypes.byref(k), lib, name.encode())
        if rc == 500:  # CUDA_ERROR_NOT_FOUND
            return None
        self.ok(rc)
        self.ok(self.cu.cuKernelGetFunction(ctypes.byref(f), k))
        return f

    def attrs(self, f: ctypes.c_void_p) -> list[int]:
        out = []
        for a in range(17):
            v = ctypes.c_int(-1)
            self.cu.cuFuncGetAttribute(ctypes.byref(v), a, f)
            out.append(v.value)
        return out

    def run(self, f: ctypes.c_void_p, values: list[float]) -> list[float]:
        n = len(values)
        host = (ctypes.c_float * n)(*values)
        dev = ctypes.c_uint64()
        self.ok(self.cu.cuMemAlloc_v2(ctypes.byref(dev), 4 * n))
        try:
            self.ok(self.cu.cuMemcpyHtoD_v2(dev, host, 4 * n))
            arg = ctypes.c_uint64(dev.value)
            params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(arg), ctypes.c_void_p))
            self.ok(self.cu.cuLaunchKernel(f, 1, 1, 1, n, 1, 1, 0, None, params, None))
            self.ok(self.cu.cuCtxSynchronize())
            self.ok(self.cu.cuMemcpyDtoH_v2(host, dev, 4 * n))
        finally:
            self.cu.cuMemFree_v2(dev)
        return list(host)


@pytest.mark.parametrize("source", ["fixture.sm_90.cubin", "fixture.fatbin"])
def test_cut_image_loads_and_computes_like_the_whole(built: Path, source: str) -> None:
    drv = Driver()
    if drv.arch != 90:
        pytest.skip(f"the fixture is built for sm_90, this GPU is sm_{drv.arch}")
    data = (built / source).read_bytes()
    cubin = kernel_images.fatbin_cubin(data, 90) if kernel_images.is_fatbin(data) else data
    assert cubin is not None
    if source == "fixture.fatbin":
        assert cubin == (built / "fixture.fatbin.sm_90.cubin").read_bytes()
    keep = {"uses_helper", "checks"}
    cut = kernel_images.prune(cubin, keep)
    assert len(cut) < len(cubin)
    whole_lib, cut_lib = drv.load(data), drv.load(cut)
    values = [float(i) - 3.0 for i in range(32)]
    for name in sorted(keep):
        whole, part = drv.kernel(whole_lib, name), drv.kernel(cut_lib, name)
        assert whole is not None and part is not None
        assert drv.attrs(part) == drv.attrs(whole)
        assert drv.run(part, values) == drv.run(whole, values)
    assert drv.kernel(cut_lib, "plain") is None and drv.kernel(cut_lib, "unused") is None
    assert drv.kernel(whole_lib, "plain") is not None
