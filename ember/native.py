"""Locating and loading libember, the native interposer (built from native/), and its control API.

The library is LD_PRELOADed into engine processes; Python reaches its control API with ctypes
through `Interposer` (see docs/native.md).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any

from ember import contract

LIB_NAME = "libember.so"
_HERE = Path(__file__).resolve().parent


def candidate_paths() -> list[Path]:
    """Where the library may be, most specific first."""
    paths: list[Path] = []
    if env := os.environ.get(contract.ENV_LIB):
        paths.append(Path(env))
    paths.append(_HERE / "lib" / LIB_NAME)  # inside an installed wheel
    # Editable installs put built files under site-packages/ember/lib.
    paths += [Path(p) / "ember" / "lib" / LIB_NAME for p in sys.path if p]
    root = _HERE.parent
    paths += [*sorted(root.glob(f"build/*/{LIB_NAME}")), root / "native" / "build" / LIB_NAME]
    return paths


def find_library() -> Path | None:
    return next((p for p in candidate_paths() if p.is_file()), None)


def load_library(path: Path | None = None) -> ctypes.CDLL:
    """dlopen the library (a no-op if it is already LD_PRELOADed: same handle)."""
    path = path or find_library()
    if path is None:
        raise FileNotFoundError(
            f"{LIB_NAME} not found; build it with `pip install -e .` or set EMBER_LIB. "
            f"Looked in: {', '.join(str(p) for p in candidate_paths()[:4])}"
        )
    return ctypes.CDLL(str(path))


# ---- the control API (native/include/ember.h) ----

MODES = ("off", "save", "load")
_STATUS = {
    -1: "invalid argument",
    -2: "not allowed in this mode",
    -3: "wrong order",
    -4: "diverged from SAVE",
    -5: "not found",
    -6: "buffer too small",
    -7: "region not reserved",
    -8: "driver error",
    -9: "no CUDA driver",
    -10: "malformed input",
    -11: "edge data not kept by the driver",
    -12: "a system library is missing",
}
EMBER_ERANGE = -6
EMBER_EDIVERGED = -4
EMBER_EEDGES = -11
EMBER_EUNAVAILABLE = -12
BUILD_INSTANTIATE = 1
FUNC_ATTRS = 6  # per kernel in `Interposer.functions` (EMBER_FUNC_ATTRS)


class GraphDesc(ctypes.Structure):
    """struct ember_graph_desc (native/include/ember.h): one graph for `Interposer.build_graphs`."""

    _fields_ = [
        ("nodes", ctypes.c_uint32),
        ("edges", ctypes.c_uint32),
        ("ops", ctypes.c_void_p),
        ("args", ctypes.c_void_p),
        ("attr_start", ctypes.c_void_p),
        ("attr_count", ctypes.c_void_p),
        ("attr_ids", ctypes.c_void_p),
        ("attr_values", ctypes.c_void_p),
        ("edge_src", ctypes.c_void_p),
        ("edge_dst", ctypes.c_void_p),
        ("edge_data", ctypes.c_void_p),
        ("flags", ctypes.c_uint32),
        ("node_handles", ctypes.c_void_p),
        ("status", ctypes.c_int32),
        ("failed_node", ctypes.c_int32),
        ("cu_result", ctypes.c_uint32),
        ("graph", ctypes.c_uint64),
        ("exec", ctypes.c_uint64),
        ("build_ns", ctypes.c_uint64),
        ("instantiate_ns", ctypes.c_uint64),
        ("error", ctypes.c_char * 240),
    ]


class BlobRead(ctypes.Structure):
    """struct ember_blob_read (native/include/ember.h): one kernel-image blob for `read_images`."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("hash", ctypes.c_char_p),
        ("path", ctypes.c_char_p),
        ("sha256", ctypes.c_char_p),
        ("raw_sha256", ctypes.c_char_p),
        ("stored_size", ctypes.c_uint64),
        ("raw_size", ctypes.c_uint64),
        ("options_json", ctypes.c_char_p),
        ("codec", ctypes.c_int32),
    ]


class CollectiveDesc(ctypes.Structure):
    """struct ember_collective (native/include/ember.h): one NCCL call to capture."""

    _fields_ = [
        ("op", ctypes.c_uint32),
        ("dtype", ctypes.c_int32),
        ("redop", ctypes.c_int32),
        ("root", ctypes.c_int32),
        ("send", ctypes.c_uint64),
        ("recv", ctypes.c_uint64),
        ("count", ctypes.c_uint64),
    ]


class EmberError(RuntimeError):
    """A control call failed; `code` is the negative ember_status, the message says why."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class EmberDivergence(EmberError):
    """The LOAD run's allocations differ from SAVE's: fall back to native capture."""


def _declare(lib: ctypes.CDLL) -> None:
    c = ctypes
    u64p, szp = c.POINTER(c.c_uint64), c.POINTER(c.c_size_t)
    sigs: dict[str, list[Any]] = {
        "ember_abi_version": [],
        "ember_get_mode": [],
        "ember_set_mode": [c.c_int],
        "ember_region": [u64p, u64p, u64p],
        "ember_arm": [],
        "ember_capture_begin": [],
        "ember_capture_end": [],
        "ember_export_alloc_log": [c.c_char_p, c.c_size_t, szp],
        "ember_import_alloc_log": [c.c_char_p, c.c_size_t],
        "ember_replay_window": [],
        "ember_replay_blockers": [c.c_char_p, c.c_size_t],
        "ember_divergence": [c.c_char_p, c.c_size_t],
        "ember_last_error": [c.c_char_p, c.c_size_t],
        "ember_catalog_json": [c.c_char_p, c.c_size_t, szp],
        "ember_lookup": [c.c_uint64, c.c_uint64, c.c_char_p, c.c_size_t, c.c_char_p, c.c_size_t],
        "ember_image_bytes": [c.c_char_p, c.c_void_p, c.c_size_t, szp],
        "ember_preload": [
            c.c_size_t, c.POINTER(c.c_char_p), c.POINTER(c.c_void_p), szp, c.POINTER(c.c_char_p),
        ],
        "ember_function": [c.c_char_p, c.c_char_p, u64p],
        "ember_functions": [
            c.c_size_t, c.POINTER(c.c_char_p), c.POINTER(c.c_char_p), c.POINTER(c.c_int32), u64p, szp,
        ],
        "ember_read_images": [c.c_void_p, c.c_size_t, c.c_int, c.POINTER(c.c_void_p)],
        "ember_read_allow": [c.c_void_p, c.c_size_t],
        "ember_read_wait": [c.c_void_p, c.c_size_t, c.c_uint32, szp],
        "ember_read_close": [c.c_void_p],
        "ember_stats_json": [c.c_char_p, c.c_size_t, szp],
        "ember_image_size": [c.c_void_p, c.c_size_t, c.POINTER(c.c_int), szp],
        "ember_hash_hex": [c.c_void_p, c.c_size_t, c.c_char_p, c.c_size_t],
        "ember_build_graphs": [c.c_uint64, c.c_void_p, c.c_size_t, c.c_int],
        "ember_exec_enable": [c.c_uint64, c.c_void_p, c.c_void_p, c.c_size_t, szp],
        "ember_capture_collectives": [
            c.c_uint64, c.c_uint64, c.c_void_p, c.c_void_p, c.c_size_t, c.c_void_p, c.c_void_p, c.c_char_p,
            c.c_size_t,
        ],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = c.c_int


IMAGE_KINDS = {1: "wrapper", 2: "fatbin", 3: "elf", 4: "ptx"}


class Interposer:
    """Python face of libember's control API (ctypes). Get one with `Interposer.attach()`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        _declare(lib)
        self._lib = lib

    @classmethod
    def attach(cls, path: Path | None = None) -> Interposer:
        """The library already in this process (LD_PRELOAD), else load it (then only the control
        API and calls made through it are interposed: preload it for a real run)."""
        if path is None:
            try:
                main = ctypes.CDLL(None)
                main.ember_abi_version  # noqa: B018 - present when LD_PRELOADed
                return cls(main)
            except AttributeError:
                pass
        return cls(load_library(path))

    # -- helpers --
    def _error(self) -> str:
        buf = ctypes.create_string_buffer(4096)
        self._lib.ember_last_error(buf, len(buf))
        return buf.value.decode(errors="replace")

    def _check(self, rc: int, what: str) -> None:
        if rc == 0:
            return
        message = self._error() or _STATUS.get(rc, f"status {rc}")
        if not message.startswith(f"{what}:"):  # libember's own messages name the call already
            message = f"{what}: {message}"
        if rc == EMBER_EDIVERGED:
            raise EmberDivergence(rc, message)
        raise EmberError(rc, message)

    def _bytes(self, fn: Any, *args: Any, what: str) -> bytes:
        needed = ctypes.c_size_t(0)
        cap = 1 << 16
        while True:
            buf = ctypes.create_string_buffer(cap)
            rc = fn(*args, buf, cap, ctypes.byref(needed))
            if rc == EMBER_ERANGE and needed.value > cap:
                cap = needed.value
                continue
            self._check(rc, what)
            return buf.raw[: needed.value]

    # -- mode and region --
    @property
    def mode(self) -> str:
        return MODES[self._lib.ember_get_mode()]

    def set_mode(self, mode: str) -> None:
        """Allowed only before the region is armed."""
        self._check(self._lib.ember_set_mode(MODES.index(mode)), "set_mode")

    def region(self) -> tuple[int, int]:
        """(base, size) of the armed region; (0, 0) when not armed."""
        base, size, heap = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        self._lib.ember_region(ctypes.byref(base), ctypes.byref(size), ctypes.byref(heap))
        return base.value, size.value

    def arm(self) -> None:
        self._check(self._lib.ember_arm(), "arm")

    # -- capture window --
    def capture_begin(self) -> None:
        self._check(self._lib.ember_capture_begin(), "capture_begin")

    def capture_end(self) -> None:
        self._check(self._lib.ember_capture_end(), "capture_end")

    def export_alloc_log(self) -> bytes:
        return self._bytes(self._lib.ember_export_alloc_log, what="export_alloc_log")

    def import_alloc_log(self, data: bytes) -> None:
        self._check(self._lib.ember_import_alloc_log(data, len(data)), "import_alloc_log")

    def replay_window(self) -> None:
        """Re-creates the capture window's allocations; raises EmberDivergence on a mismatch."""
        self._check(self._lib.ember_replay_window(), "replay_window")

    def replay_blockers(self) -> tuple[int, str]:
        """Before replay_window(): how many blocks SAVE freed inside its capture window this
        process still holds (the replay would refuse them: release first), the first described."""
        buf = ctypes.create_string_buffer(1024)
        n = int(self._lib.ember_replay_blockers(buf, len(buf)))
        self._check(min(n, 0), "replay_blockers")
        return n, buf.value.decode(errors="replace")

    def divergence(self) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        return buf.value.decode(errors="replace") if self._lib.ember_divergence(buf, len(buf)) else None

    # -- kernel catalog --
    def catalog(self) -> list[dict[str, Any]]:
        return json.loads(self._bytes(self._lib.ember_catalog_json, what="catalog"))

    def lookup(self, func: int, kern: int) -> tuple[str, str] | None:
        """(image hash, kernel name) of a graph node's CUfunction / CUkernel; None if unknown."""
        h, n = ctypes.create_string_buffer(64), ctypes.create_string_buffer(4096)
        rc = self._lib.ember_lookup(func or 0, kern or 0, h, len(h), n, len(n))
        if rc == -5:
            return None
        self._check(rc, "lookup")
        return h.value.decode(), n.value.decode()

    def image_bytes(self, hash: str) -> bytes:
        return self._bytes(self._lib.ember_image_bytes, hash.encode(), what="image_bytes")

    def preload(self, images: list[tuple[str, bytes, dict[str, Any]]]) -> None:
        """Starts loading the images (in this order) on worker threads."""
        n = len(images)
        hashes = (ctypes.c_char_p * n)(*[h.encode() for h, _, _ in images])
        # Pointers into the bytes objects themselves: libember copies each image before it
        # returns, so a second copy here (create_string_buffer) only cost time.
        views = [ctypes.c_char_p(bytes(data)) for _, data, _ in images]
        ptrs = (ctypes.c_void_p * n)(*[ctypes.cast(v, ctypes.c_void_p).value for v in views])
        sizes = (ctypes.c_size_t * n)(*[len(data) for _, data, _ in images])
        opts = (ctypes.c_char_p * n)(*[json.dumps(o or {}).encode() for _, _, o in images])
        self._check(self._lib.ember_preload(n, hashes, ptrs, sizes, opts), "preload")

    def read_images(self, blobs: list[BlobRead], threads: int = 4) -> ImageReads:
        """libember's reader threads read, verify and preload these kernel-image blobs (in this
        order, as far as `ImageReads.allow` lets them). EmberError with EMBER_EUNAVAILABLE
        when libzstd or libcrypto is missing here."""
        arr = (BlobRead * len(blobs))(*blobs)
        handle = ctypes.c_void_p()
        rc = self._lib.ember_read_images(arr, len(blobs), threads, ctypes.byref(handle))
        self._check(rc, "read_images")
        return ImageReads(self, handle)

    def function(self, hash: str, name: str) -> int:
        """A CUfunction for the current context (waits only for this image's preload)."""
        out = ctypes.c_uint64()
        self._check(self._lib.ember_function(hash.encode(), name.encode(), ctypes.byref(out)), "function")
        return out.value

    def functions(self, kernels: list[tuple[str, str, tuple[int, ...]]]) -> list[int]:
        """`function` for each (image hash, name, attributes) in one call, each function given
        its FUNC_ATTRS attributes (-1: leave as loaded) where it differs."""
        n = len(kernels)
        hashes = (ctypes.c_char_p * n)(*[h.encode() for h, _, _ in kernels])
        names = (ctypes.c_char_p * n)(*[k.encode() for _, k, _ in kernels])
        attrs = (ctypes.c_int32 * (n * FUNC_ATTRS))(*[v for _, _, a in kernels for v in a])
        funcs, failed = (ctypes.c_uint64 * n)(), ctypes.c_size_t()
        rc = self._lib.ember_functions(n, hashes, names, attrs, funcs, ctypes.byref(failed))
        self._check(rc, "function")
        return list(funcs)

    def build_graphs(self, ctx: int, descs: ctypes.Array[GraphDesc], threads: int) -> int:
        """ember_build_graphs; returns its status (each desc says how its graph went). Raises
        only when the call itself is unusable (no driver, bad arguments)."""
        rc = self._lib.ember_build_graphs(ctx, ctypes.addressof(descs), len(descs), threads)
        if rc in (-1, -9) and all(d.status == 0 and d.graph == 0 for d in descs):
            self._check(rc, "build_graphs")
        return int(rc)

    def exec_enable(self, exec_handle: int, nodes: Any, on: Any) -> None:
        """ember_exec_enable: node i of `nodes` (uint64 CUgraphNodes, a numpy array) enabled in the
        exec where on[i] (uint8), else disabled. EmberError names the node the driver refused."""
        n, failed = len(nodes), ctypes.c_size_t()
        if len(on) != n:
            raise ValueError(f"{n} nodes, {len(on)} flags")
        rc = self._lib.ember_exec_enable(exec_handle, nodes.ctypes.data, on.ctypes.data, n,
                                         ctypes.byref(failed))
        self._check(rc, "exec_enable")

    def capture_collectives(
        self, comm: int, groups: list[list[tuple[int, int, int, int, int, int, int]]], ctx: int = 0
    ) -> tuple[list[int], list[int]]:
        """ember_capture_collectives: each group (one or several NCCL calls as (op, dtype, redop,
        root, send, recv, count)) captured into its own CUgraph with the communicator `comm`;
        returns (graph handles, shape hashes). EmberError when NCCL or the driver refuses one
        (then none is kept)."""
        flat = [c for g in groups for c in g]
        calls = (CollectiveDesc * max(len(flat), 1))(*[CollectiveDesc(*c) for c in flat])
        starts = (ctypes.c_uint32 * (len(groups) + 1))()
        for i, g in enumerate(groups):
            starts[i + 1] = starts[i] + len(g)
        graphs = (ctypes.c_uint64 * max(len(groups), 1))()
        shapes = (ctypes.c_uint64 * max(len(groups), 1))()
        err = ctypes.create_string_buffer(512)
        addr = ctypes.addressof
        rc = self._lib.ember_capture_collectives(
            ctx, comm, addr(calls), addr(starts), len(groups), addr(graphs), addr(shapes), err, len(err)
        )
        if rc != 0:
            raise EmberError(rc, f"capture_collectives: {err.value.decode(errors='replace')}")
        return list(graphs)[: len(groups)], list(shapes)[: len(groups)]

    def stats(self) -> dict[str, Any]:
        return json.loads(self._bytes(self._lib.ember_stats_json, what="stats"))

    # -- helpers exposed for tests and tools --
    def image_size(self, address: int, limit: int = 0) -> tuple[str, int]:
        kind, size = ctypes.c_int(), ctypes.c_size_t()
        self._check(self._lib.ember_image_size(address, limit, ctypes.byref(kind), ctypes.byref(size)),
                    "image_size")
        return IMAGE_KINDS.get(kind.value, "unknown"), size.value

    def hash(self, data: bytes) -> str:
        out = ctypes.create_string_buffer(64)
        self._check(self._lib.ember_hash_hex(data, len(data), out, len(out)), "hash")
        return out.value.decode()


class ImageReads:
    """Blobs being read by libember (`Interposer.read_images`); close() stops the readers."""

    def __init__(self, ip: Interposer, handle: ctypes.c_void_p) -> None:
        self._ip = ip
        self._handle: ctypes.c_void_p | None = handle

    def allow(self, upto: int) -> None:
        """The readers may read the first `upto` blobs."""
        self._ip._lib.ember_read_allow(self._handle, upto)

    def wait(self, upto: int, timeout: float) -> int:
        """How many leading blobs are preloaded, once `upto` are or `timeout` seconds passed
        (the GIL is released meanwhile). EmberError names the first damaged blob."""
        done = ctypes.c_size_t()
        ms = max(0, min(int(timeout * 1e3), 2**32 - 1))
        rc = self._ip._lib.ember_read_wait(self._handle, upto, ms, ctypes.byref(done))
        self._ip._check(rc, "read_images")
        return done.value

    def close(self) -> None:
        if self._handle is not None:
            self._ip._lib.ember_read_close(self._handle)
            self._handle = None
