"""Finding kernels: graph node function handle → KernelRef (SAVE) and KernelRef → CUfunction (LOAD).

Two resolvers share one small protocol:
- `NativeResolver` asks libember's catalog (content hash of the loaded image + mangled name).
  Archives built with it can be LOADed in another process.
- `LiveResolver` names kernels after the module handle of THIS process. It needs no native
  library and serves in-process proofs and tests (walk → encode → decode → rebuild → replay);
  archives built with it are marked in-process-only and never published.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
from cuda.bindings import driver as cu

from ember.archive.graphs import FunctionAttrs, KernelRef
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


class KernelFunctions:
    """The function handles of a graph table's kernels, each resolved (and given its SAVE-time
    function attributes) the first time a graph being prepared needs it.

    LOAD resolves through libember, which waits for the kernel's own image only: the first
    template waits for the images its kernels live in, not for every image of the archive. A
    kernel that cannot be resolved raises from the prepare that needed it.
    """

    def __init__(
        self,
        count: int,
        resolve: Callable[[int], int] | None = None,
        attrs: Sequence[FunctionAttrs] | None = None,
        apply_attrs: Callable[[int, FunctionAttrs], None] | None = None,
        resolve_many: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        """Either `resolve` (then `apply_attrs(func, attrs[i])`) per kernel, or `resolve_many`:
        every missing kernel of a take() resolved, with its attributes, in one call (libember's
        ember_functions)."""
        if (resolve is None) == (resolve_many is None):
            raise TypeError("KernelFunctions takes one of resolve and resolve_many")
        self._count = count
        self._resolve = resolve  # kernel index -> CUfunction
        self._resolve_many = resolve_many
        self._attrs = attrs
        self._apply = apply_attrs
        self._funcs = np.zeros(self._count, dtype=np.uint64)
        self._have = np.zeros(self._count, dtype=bool)
        self._lock = threading.Lock()
        self.resolve_ms = 0.0  # lookups (libember: includes waiting for the image's load)
        self.attrs_ms = 0.0

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> int:
        return int(self.take(np.asarray([i]))[0])

    def __iter__(self) -> Iterator[int]:
        return iter(self.take(np.arange(self._count)).tolist())

    @property
    def resolved(self) -> int:
        return int(self._have.sum())

    def take(self, idx: np.ndarray) -> np.ndarray:
        """The handles (uint64) of kernels `idx` (table indices), resolving those not resolved yet."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and not self._have[idx].all():
            self._fill(np.unique(idx[~self._have[idx]]).tolist())
        return self._funcs[idx]

    def _fill(self, missing: list[int]) -> None:
        with self._lock:
            if self._resolve_many is not None:
                todo = [i for i in missing if not self._have[i]]
                t = time.perf_counter()
                self._funcs[todo] = self._resolve_many(todo) if todo else []
                self._have[todo] = True
                self.resolve_ms += (time.perf_counter() - t) * 1e3  # attributes included
                return
            assert self._resolve is not None
            for i in missing:
                if self._have[i]:
                    continue
                t = time.perf_counter()
                func = self._resolve(i)
                t1 = time.perf_counter()
                if self._attrs is not None and self._apply is not None:
                    self._apply(func, self._attrs[i])
                self.resolve_ms += (t1 - t) * 1e3
                self.attrs_ms += (time.perf_counter() - t1) * 1e3
                self._funcs[i] = func
                self._have[i] = True


Functions = Sequence[int] | KernelFunctions  # plain handles (in-process, tests) or resolved on need


def handles(functions: Functions, idx: np.ndarray) -> np.ndarray:
    """The handles of kernels `idx`, as uint64."""
    if isinstance(functions, KernelFunctions):
        return functions.take(idx)
    return np.asarray(functions, dtype=np.uint64)[idx]
