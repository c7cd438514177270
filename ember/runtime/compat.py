"""The compatibility key of THIS process: real GPU, driver, CUDA, torch, triton, engine, env.

SAVE stamps it into the manifest; LOAD compares it with the archive's before touching any graph
(`check`). A mismatch is a refusal with a readable reason, never an error page.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

from cuda.bindings import driver as cu

from ember.identity import COMPAT_ENV_VARS, CompatKey
from ember.runtime.graphs.driver import check


def _driver_version() -> str:
    check(cu.cuInit(0), "cuInit")
    v = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
    try:
        import pynvml  # nvidia-ml-py: the driver's full version string (e.g. 580.159.04)

        pynvml.nvmlInit()
        full = pynvml.nvmlSystemGetDriverVersion()
        return full.decode() if isinstance(full, bytes) else str(full)
    except Exception:  # pynvml missing or NVML unavailable: the CUDA driver API version suffices
        return f"cuda-driver-api {v // 1000}.{v % 1000 // 10}"


def _triton_version() -> str:
    """Triton's version without importing it: a LOAD process never compiles anything, and the
    import (a large package) ran inside LOAD's timed read stage."""
    mod = sys.modules.get("triton")
    if mod is not None:
        return str(getattr(mod, "__version__", ""))
    for dist in ("triton", "pytorch-triton"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def current(engine: str = "", device: int = 0) -> CompatKey:
    """The key of the GPU this process runs on."""
    import torch

    check(cu.cuInit(0), "cuInit")
    dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
    name = check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
    attr = cu.CUdevice_attribute
    major = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cc")
    minor = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cc")
    env = {k: os.environ[k] for k in COMPAT_ENV_VARS if k in os.environ}
    return CompatKey(
        gpu_name=name,
        compute_capability=f"{major}.{minor}",
        driver=_driver_version(),
        cuda=torch.version.cuda or "",
        torch=torch.__version__,
        triton=_triton_version(),
        engine=engine,
        env=env,
    )


def check_compat(archived: CompatKey, here: CompatKey) -> list[str]:
    """Differences between the archive's key and this process's (empty = compatible)."""
    return archived.mismatches(here)
