"""Finding kernels: graph node function handle → KernelRef (SAVE) and KernelRef → CUfunction (LOAD).

Two resolvers share one small protocol:
- `NativeResolver` asks libember's catalog (content hash of the loaded image + mangled name).
  Archives built with it can be LOADed in another process.
- `LiveResolver` names kernels after the module handle of THIS process. It needs no native
  library and serves in-process proofs and tests (walk → encode → decode → rebuild → replay);
  archives built with it are marked in-process-only and never published.
"""

from __future__ import annotations

from typing import Any, Protocol

from cuda.bindings import driver as cu

from ember.archive.graphs import KernelRef
from ember.runtime.graphs.driver import OK, CudaError, check

LIVE_PREFIX = "live-"


class KernelNotFound(LookupError):
    """A graph's kernel has no catalog entry, so LOAD could not find it again."""


class KernelResolver(Protocol):
    in_process_only: bool

    def lookup(self, func: int, kern: int) -> KernelRef: ...

    def function(self, ref: KernelRef) -> int: ...

    def function_list(self, refs: list[KernelRef]) -> list[int]: ...


def function_name(func: int) -> str:
    name = check(cu.cuFuncGetName(cu.CUfunction(func)), "cuFuncGetName")
    return name.decode() if isinstance(name, bytes) else str(name)


class LiveResolver:
    """Kernels of this process only: image = the module handle, name = cuFuncGetName."""

    in_process_only = True

    def __init__(self) -> None:
        self._functions: dict[KernelRef, int] = {}

    def lookup(self, func: int, kern: int) -> KernelRef:
        if not func:
            func = int(check(cu.cuKernelGetFunction(cu.CUkernel(kern)), "cuKernelGetFunction"))
        err, mod = cu.cuFuncGetModule(cu.CUfunction(func))
        owner = int(mod) if err == OK else func
        ref = KernelRef(image=f"{LIVE_PREFIX}{owner:x}", name=function_name(func))
        self._functions.setdefault(ref, func)
        return ref

    def function(self, ref: KernelRef) -> int:
        try:
            return self._functions[ref]
        except KeyError:
            raise CudaError(
                "LiveResolver.function", f"kernel {ref.name} was not seen in this process"
            ) from None

    def function_list(self, refs: list[KernelRef]) -> list[int]:
        return [self.function(r) for r in refs]


class NativeResolver:
    """Kernels found through libember's catalog (see ember.native.Interposer)."""

    in_process_only = False

    def __init__(self, interposer: Any) -> None:
        self._ip = interposer

    def lookup(self, func: int, kern: int) -> KernelRef:
        found = self._ip.lookup(func, kern)
        if found is None:
            name = function_name(func) if func else f"CUkernel {kern:#x}"
            raise KernelNotFound(
                f"kernel {name} is not in libember's catalog (loaded before the interposer?)"
            )
        return KernelRef(image=str(found[0]), name=str(found[1]))

    def function(self, ref: KernelRef) -> int:
        return int(self._ip.function(ref.image, ref.name))

    def function_list(self, refs: list[KernelRef]) -> list[int]:
        return [self.function(r) for r in refs]


def is_live(ref: KernelRef) -> bool:
    return ref.image.startswith(LIVE_PREFIX)
