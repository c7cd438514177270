"""The engine process's session with libember: context first, then (optionally) perturb, then arm.

`ember save` / `ember load` re-execute themselves with LD_PRELOAD=libember.so, EMBER_MODE and
EMBER_ARM=manual (`preload_env`), so the region is armed at a known point: after the CUDA
context exists and after anything the process did before (the perturbation tests and benchmark
allocate there on purpose, to prove that the layout, not luck, brings addresses back).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from cuda.bindings import driver as cu

from ember import contract, native
from ember.runtime.graphs.driver import check


def ensure_context(device: int = 0) -> Any:
    """Make the device's primary context current (the one torch/cudart use) and initialise the
    CUDA runtime, so whatever either does at start-up happens before arming, in every process."""
    import torch

    check(cu.cuInit(0), "cuInit")
    dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    torch.cuda.init()
    torch.cuda.set_device(device)
    return ctx


def preloaded() -> bool:
    return "libember" in os.environ.get("LD_PRELOAD", "")


def perturb() -> list[Any]:
    """Allocations before arming that shift any unpinned layout (torch and raw driver)."""
    import torch

    keep: list[Any] = [torch.empty(96 << 20, dtype=torch.uint8, device="cuda")]
    keep.append(check(cu.cuMemAlloc(6 << 20), "cuMemAlloc"))
    torch.cuda.synchronize()
    return keep


_KEEP: list[Any] = []


def native_session(expected_mode: str, *, perturb_first: bool = False) -> native.Interposer | None:
    """The preloaded Interposer in `expected_mode`, armed; None when libember is not preloaded."""
    ensure_context()
    if perturb_first:
        _KEEP.extend(perturb())
    if not preloaded():
        return None
    ip = native.Interposer.attach()
    if ip.mode != expected_mode:
        raise RuntimeError(f"libember is in mode {ip.mode!r}, this step needs {expected_mode!r} (EMBER_MODE)")
    ip.arm()
    return ip


def preload_env(mode: str, env: dict[str, str] | None = None, *, comm_stub: bool = False) -> dict[str, str]:
    """Environment for a child (or re-exec) running under libember in `mode`. `comm_stub`: also
    preload libember_nccl after it (SAVE of a multi-GPU shape on one GPU, `ember.runtime.comm`)."""
    env = dict(os.environ if env is None else env)
    lib = native.find_library()
    if lib is None:
        raise FileNotFoundError("libember.so not found: build it (pip install -e .) or set EMBER_LIB")
    pre = env.get("LD_PRELOAD", "")
    if "libember" not in pre:
        env["LD_PRELOAD"] = f"{lib}:{pre}" if pre else str(lib)
    if not comm_stub:  # a stub inherited from a SAVE parent never reaches another process
        env["LD_PRELOAD"] = ":".join(p for p in env["LD_PRELOAD"].split(":") if "libember_nccl" not in p)
    elif "libember_nccl" not in env["LD_PRELOAD"]:
        stub = lib.with_name("libember_nccl.so")
        if not stub.is_file():
            raise FileNotFoundError(f"{stub} not found: build libember (it builds the NCCL stub too)")
        first, _, rest = env["LD_PRELOAD"].partition(":")
        env["LD_PRELOAD"] = ":".join(p for p in (first, str(stub), rest) if p)
    env["EMBER_MODE"] = mode
    env.setdefault("EMBER_ARM", "manual")
    env[contract.ENV_LIB] = str(lib)
    return env


def ember_argv(*args: str) -> list[str]:
    """argv that runs `ember <args>` with this interpreter (no console script needed)."""
    run = "import sys; from ember.cli import app; sys.argv[0] = 'ember'; app()"
    return [sys.executable, "-c", run, *args]


def reexec_under_libember(mode: str, *, comm_stub: bool = False) -> None:
    """Replace this process with itself under libember (no-op when already preloaded)."""
    stubbed = "libember_nccl" in os.environ.get("LD_PRELOAD", "")
    if preloaded() and os.environ.get("EMBER_MODE") == mode and stubbed == comm_stub:
        return
    env = preload_env(mode, comm_stub=comm_stub)
    argv = ember_argv(*sys.argv[1:])
    os.execve(sys.executable, argv, env)
