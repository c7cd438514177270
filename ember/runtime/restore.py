"""The LOAD steps every engine shares, split around the engine's own start-up.

`ArchiveRestore.open()` reads the manifest, checks the compatibility key, reads the allocation
log and imports it (the engine's allocations are checked against SAVE's from then on); then it
starts the rest on a background thread — the graph table read and decoded, the first needed
key's kernel images read, verified and handed to libember's loaders (proactive loading), its
group's template built while a reader thread does the same for every other blob, then one
template per topology group built and instantiated, each graph's kernel functions resolved as it
is prepared — while the engine builds its model and KV cache on the caller's thread (Foundry
§4.2.1). That is safe before the capture window's
allocations are replayed: libember maps the whole saved extent of its heap when the log is
imported, so every address a node refers to is mapped already, and nothing is launched until
`library()` hands the templates over after `replay()`. A damaged blob found in the background
refuses the archive there, still before any launch.

`ember.runtime.load` drives it for every engine adapter::

    restore = ArchiveRestore.open(ip, store_uri, identity, engine, accept=...)   # Refused
    ... the adapter builds the model and the KV cache; static addresses checked ...
    restore.replay()                                                             # Refused
    lib = restore.library()                                                      # Refused

Any refusal means: capture natively. A background build the driver refused is tried once more on
the caller's thread after the replay; only a second refusal refuses the archive. After the
hand-over (the first template built), a template that fails on the background thread (the driver,
or a kernel its image does not hold) is built again at its group's first launch, which raises if
it fails again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cuda.bindings import driver as cu

from ember import settings
from ember.archive import graph_table
from ember.archive.table_layout import FormatError
from ember.native import EmberDivergence, EmberError, Interposer
from ember.runtime import compat, image_reads, publish
from ember.runtime.adapter import COMPAT, LOAD, Refused
from ember.runtime.gil import short_switch_interval
from ember.runtime.graphs.driver import CudaError, current_context
from ember.runtime.graphs.kernels import KernelFunctions
from ember.runtime.graphs.need import need_order
from ember.runtime.graphs.rebuild import RebuildError
from ember.runtime.graphs.templates import GraphLibrary
from ember.runtime.thread_names import name_this_thread

if TYPE_CHECKING:
    from ember.archive import bundle
    from ember.archive.graph_table import GraphTable
    from ember.archive.graphs import FunctionAttrs
    from ember.archive.manifest import Manifest


READ_AHEAD = 8  # images the reader reads before the decoded table says which the first key needs


def _attr_values(fa: FunctionAttrs) -> tuple[int, ...]:
    """`Interposer.functions`' attributes of one kernel (rebuild.apply_function_attr's)."""
    return (fa.max_dynamic_shared, fa.non_portable_cluster, *fa.required_cluster, fa.carveout)


def release_cached_memory(ip: Interposer | None = None) -> dict[str, float]:
    """Give torch's cached, unused segments back before `replay_window()`.

    SAVE's first capture emptied torch's cache inside the capture window (torch.cuda.graph does),
    and graph memory reused that space. A LOAD process never captures: without this its
    allocator would keep those segments and later hand the graphs' memory to eager tensors (seen
    on H100: fingerprinting a restored graph's logits overwrote its token output). libember keeps
    the released blocks until the replay frees them at SAVE's place, and refuses the replay if
    the process still holds one (benchmarks/results/diag-load-outputs-H100-*.json).

    torch.cuda.graph also runs `gc.collect()` first (a tensor only a reference cycle holds keeps
    its block); that costs 130-165 ms in an engine process (H100), so it runs only when libember
    (`ip.replay_blockers()`) says a block the replay needs is still held after emptying the
    cache. Returns the milliseconds of each step."""
    import gc

    import torch

    ms: dict[str, float] = {}
    t = time.perf_counter()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ms["release_empty_cache_ms"] = (time.perf_counter() - t) * 1e3
    if ip is None or ip.replay_blockers()[0] > 0:
        t = time.perf_counter()
        gc.collect()
        torch.cuda.empty_cache()
        ms["release_gc_ms"] = (time.perf_counter() - t) * 1e3
    return ms


def _timed(step: Callable[[], Any]) -> float:
    """Milliseconds `step()` took."""
    t = time.perf_counter()
    step()
    return (time.perf_counter() - t) * 1e3


def _splicer(facts: dict[str, Any], communicator: Any) -> Any:
    """This rank's Splicer when the archive holds collective placeholders (refuse without a
    communicator). `communicator`: an `ember.runtime.comm.Communicators`, or (ncclComm_t, world,
    rank) of the world's one communicator."""
    if "collectives" not in facts:
        return None
    from ember.runtime import comm

    try:
        table = comm.Collectives.from_facts(facts["collectives"])
    except (KeyError, TypeError, ValueError) as exc:
        raise Refused(LOAD, f"archive's collective table is not readable: {type(exc).__name__}: "
                            f"{exc}") from exc
    if communicator is None:
        raise Refused(LOAD, f"collectives for a world of {table.world} in the archive, no communicator here")
    return comm.Splicer(table, comm.Communicators.of(communicator))


def _accept(opened: bundle.Archive, accept: Callable[[dict[str, Any]], Any] | None,
            attached: Callable[[bundle.Archive], Any] | None, tm: dict[str, Any]) -> Any:
    """The engine's attachments put in place, then the engine's verdict on the archive's facts."""
    if opened.manifest.engine.get("in_process_only"):
        raise Refused(COMPAT, "archive was saved without libember (in-process only)")
    if attached is not None and opened.manifest.attachments:
        t = time.perf_counter()
        attached(opened)
        tm["attachments_ms"] = (time.perf_counter() - t) * 1e3
    return accept(dict(opened.manifest.engine)) if accept is not None else None


def _open(store_uri: str, identity_hash: str) -> bundle.Archive:
    """The archive's manifest (signature first when EMBER_TRUSTED_KEYS is set), or Refused."""
    try:
        return publish.open_archive(store_uri, identity_hash)
    except (publish.bundle.ArchiveUntrusted, publish.signing.SigningKeyError) as exc:
        # a trust list is set: no blob of an archive without a trusted signature is read
        raise Refused(LOAD, f"archive signature refused: {exc}") from exc
    except Exception as exc:
        raise Refused(LOAD, f"archive not readable: {exc}") from exc


class ArchiveRestore:
    """One archive on its way into this process; see the module docstring for the order."""
    def __init__(self, ip: Interposer, opened: bundle.Archive, timings: dict[str, Any]) -> None:
        self.ip = ip
        self.opened = opened
        self.archive: publish.ArchiveContent | None = None  # every blob, read and verified (background)
        self.accepted: Any = None
        self.splicer: Any = None  # ember.runtime.comm.Splicer for a multi-GPU archive
        self.timings = timings
        self._lib: GraphLibrary | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._reader: threading.Thread | None = None  # reads every blob but the table (`_read_blobs`)
        self._reader_error: BaseException | None = None
        self._handed: dict[str, threading.Event] = {}  # per kernel image: handed to libember
        self._stop_reading = threading.Event()  # the reconstruction failed: the reader stops
        # The reader reads the first needed key's images, then holds back until that key's
        # template is in libember's builder: its Python took turns for the GIL with the table
        # decode and the template's preparation (H100: the table's read and decode took 58-84 ms
        # beside it; alone it takes ~5 ms on a 2-core VM).
        self._first_upto: int | None = None  # images of `image_order` the first key needs read
        self._position: dict[str, int] = {}  # each image's place in `image_order`
        self._decoded = threading.Event()  # the table is decoded (or failed to): `_first_upto` is known
        self._rest = threading.Event()  # the reader may read the other blobs now
        self._handover = threading.Event()  # the first template is ready, or the thread ended
        self._serving = threading.Event()  # library() handed the library over

    @property
    def manifest(self) -> Manifest:
        return self.opened.manifest

    @classmethod
    def open(
        cls,
        ip: Interposer | None,
        store_uri: str,
        identity_hash: str,
        engine: str,
        *,
        accept: Callable[[dict[str, Any]], Any] | None = None,
        attached: Callable[[bundle.Archive], Any] | None = None,
        background: bool | None = None,
        communicator: Any = None,
        splice_now: bool = False,
    ) -> ArchiveRestore:
        """Everything before the engine builds its model. `engine` is the compat key's engine
        string of this process (`compat.current(engine)`); `accept(manifest.engine)` may refuse
        (Refused) an archive from another engine before its blobs are read; what it returns
        is kept as `accepted` (e.g. the engine's sizing); `attached(archive)` first puts the
        archive's attachments in place (vLLM's compile cache). `background` (default: unless
        EMBER_LOAD_BACKGROUND=0) builds the templates while the model builds.
        `communicator`: this rank's `ember.runtime.comm.Communicators` (or (ncclComm_t, world,
        rank) of its one communicator), for an archive with collective placeholders (created
        before this call, as the engine does natively); `splice_now`: its collectives captured
        in this call rather than on the background thread."""
        if ip is None:
            raise Refused(LOAD, "libember is not preloaded with EMBER_MODE=load")
        tm: dict[str, Any] = {}
        t0 = t = time.perf_counter()
        opened = _open(store_uri, identity_hash)
        manifest = opened.manifest
        tm["read_manifest_ms"] = (time.perf_counter() - t) * 1e3
        problems = compat.check_compat(manifest.compat, compat.current(engine))
        tm["read_compat_ms"] = (time.perf_counter() - t) * 1e3 - tm["read_manifest_ms"]
        if problems:
            raise Refused(COMPAT, "compatibility key differs: " + "; ".join(problems))
        accepted = _accept(opened, accept, attached, tm)
        splicer = _splicer(manifest.engine, communicator)
        t = time.perf_counter()
        try:
            alloc_log = opened.alloc_log or b""
        except Exception as exc:
            raise Refused(LOAD, f"archive damaged: {exc}") from exc
        tm["read_alloc_log_ms"] = (time.perf_counter() - t) * 1e3
        tm["read_ms"] = (time.perf_counter() - t0) * 1e3  # manifest, compat, allocation log
        t = time.perf_counter()
        try:
            ip.import_alloc_log(alloc_log)  # also maps the heap's saved extent
        except EmberError as exc:
            raise Refused(LOAD, f"libember refused the archive: {exc}") from exc
        tm["import_alloc_log_ms"] = (time.perf_counter() - t) * 1e3
        if splice_now and splicer is not None:  # after the import: the collectives' buffers are mapped
            tm["splice_now_ms"] = _timed(splicer.capture)
        self = cls(ip, opened, tm)
        self.accepted = accepted
        self.splicer = splicer
        if background is None:
            background = settings.on("EMBER_LOAD_BACKGROUND")
        if background:
            self._start_background()
        return self

    def _start_background(self) -> None:
        ctx = current_context()

        def run() -> None:
            name_this_thread()
            with short_switch_interval():  # the engine's build holds the GIL meanwhile (gil.py)
                self._reconstruct(ctx)

        self._thread = threading.Thread(target=run, name="ember-reconstruct", daemon=True)
        self._thread.start()

    def _reconstruct(self, ctx: Any = None, prefix: str = "") -> None:
        """Read the table and the blobs (the first key's images first, handed to libember's
        loaders), resolve functions, build and instantiate the templates. On the background
        thread (`ctx` given), errors are kept for `library()`; on the caller's, they propagate.
        Timings are kept under `prefix`."""
        tm: dict[str, float] = {}
        t_all = time.perf_counter()
        try:
            if ctx is not None:
                cu.cuCtxSetCurrent(ctx)
            try:
                lib = self._build_first(self._read(tm), tm)
            except BaseException:
                self._stop_reading.set()  # no reader is left behind, loading for nothing
                if (damaged := self._join_reader(tm)) is not None:
                    raise damaged from None  # the cause (an image that never came), not its effect
                raise
            if (damaged := self._join_reader(tm)) is not None:
                lib.close()
                raise damaged
            tm["library_first_ms"] = (time.perf_counter() - t_all) * 1e3
            self.timings.update({prefix + k: v for k, v in tm.items()})
            self._lib = lib
            self._handover.set()  # library() may hand it over now; the rest follows here
            self._build_rest(lib, tm, background=ctx is not None)
        except BaseException as exc:
            if ctx is None:
                raise
            if self._lib is None:
                self._error = exc
            else:  # after the hand-over: the templates left unbuilt are built at their first launch
                self.timings["background_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            tm["reconstruct_ms"] = (time.perf_counter() - t_all) * 1e3
            self.timings.update({prefix + k: v for k, v in tm.items()})
            self._handover.set()

    def _read(self, tm: dict[str, float]) -> GraphTable:
        """Starts the reader thread (`_read_blobs`), then reads and decodes the graph table here
        meanwhile."""
        arc = self.opened
        self._reader_error = None
        self._stop_reading = threading.Event()
        self._first_upto, self._rest, self._decoded = None, threading.Event(), threading.Event()
        self._handed = {h: threading.Event() for h in publish.image_order(arc.manifest)}
        self._position = {h: i for i, h in enumerate(self._handed)}
        self._reader = threading.Thread(target=self._read_blobs, args=(tm,), name="ember-read", daemon=True)
        self._reader.start()
        t = time.perf_counter()
        try:
            # the header and index; each graph's chunk is decoded when it is prepared, in need order
            table: GraphTable = graph_table.decode(arc.blob_bytes(arc.manifest.graphs.table))
            first = table.chunk(need_order(table.keys)[0]).kpar["kernel"].tolist() if len(table) else []
            images = {table.kernels[k].image for k in set(first)}
            # Its child graphs' kernels are not in its chunk: a lookup of one lets the reader go on.
            self._first_upto = max((self._position[h] + 1 for h in images if h in self._position), default=0)
        except Exception as exc:
            raise Refused(LOAD, f"archive damaged: {exc}") from exc
        finally:
            self._decoded.set()
        tm["read_table_ms"] = (time.perf_counter() - t) * 1e3
        tm["images_first"] = len(images)
        return table

    def _read_blobs(self, tm: dict[str, Any]) -> None:
        """Every kernel image read and verified, in the archive's order (`image_reads`: by
        libember's reader threads for a local store): SAVE writes it need-first, so the first
        needed key's images lead. Each is handed to libember's loader threads as soon as it and
        those before it are read. Once the first key's images are handed, it waits until that
        key's template goes to libember's builder (`_rest`), then reads every other blob. A
        damaged blob is kept for `_join_reader`."""
        name_this_thread()
        arc = self.opened
        order = list(self._handed)
        t = time.perf_counter()
        reads: image_reads.Reads | None = None
        try:
            reads = image_reads.open_reads(self.ip, arc, order)
            tm["image_reader"] = reads.kind
            i = 0
            while i < len(order) and not self._stop_reading.is_set():  # what is read, in order
                upto = self._may_read(len(order))
                if i >= upto:  # the first key's images are handed: its template comes first
                    if self._first_upto is not None:
                        tm.setdefault("images_held_ms", (time.perf_counter() - t) * 1e3)
                    (self._rest if self._decoded.is_set() else self._decoded).wait()
                    continue
                reads.allow(upto)
                j = reads.wait(i, 0.05)
                if j > i:
                    tm.setdefault("images_handed_first_ms", (time.perf_counter() - t) * 1e3)
                for h in order[i:j]:
                    self._handed[h].set()
                i = j
            if self._stop_reading.is_set():
                return
            tm["images_handed_ms"] = (time.perf_counter() - t) * 1e3
            try:  # what is left (the RNG state), then the whole view
                self.archive = publish.view(arc, images=reads.kind != "native")
            except Exception as exc:
                raise Refused(LOAD, f"archive damaged: {exc}") from exc
        except BaseException as exc:
            self._reader_error = exc
        finally:
            if reads is not None:
                reads.close()
            for ev in self._handed.values():  # no lookup waits for an image that will not come
                ev.set()
            tm["read_blobs_ms"] = (time.perf_counter() - t) * 1e3

    def _may_read(self, n: int) -> int:
        """How many of the `n` images the reader may read now: all once `_rest` is set; before,
        the first key's (READ_AHEAD while the table that names them is being decoded)."""
        if self._rest.is_set():
            return n
        if self._first_upto is not None:
            return min(self._first_upto, n)
        return n if self._decoded.is_set() else min(READ_AHEAD, n)  # decoded: it failed, read on

    def _functions(self, table: GraphTable, idx: list[int]) -> list[int]:
        """The kernels' CUfunctions with their SAVE-time attributes (one libember call), once the
        reader handed their images to libember (which then waits for each image's load only)."""
        refs, attrs = table.kernels, table.function_attrs
        for image in {refs[i].image for i in idx}:
            if (handed := self._handed.get(image)) is not None:
                if not handed.is_set() and self._position[image] >= (self._first_upto or 0):
                    self._rest.set()  # past the first key's images (a child graph's kernel): read on
                handed.wait()
        return self.ip.functions([(refs[i].image, refs[i].name, _attr_values(attrs[i])) for i in idx])

    def _join_reader(self, tm: dict[str, float]) -> BaseException | None:
        """Waits for the reader: every blob is read and verified before the hand-over. Returns
        what refuses the archive (a damaged blob), if anything."""
        t = time.perf_counter()
        self._rest.set()  # a reader still holding back would never end
        if self._reader is not None:
            self._reader.join()
        tm["reader_wait_ms"] = (time.perf_counter() - t) * 1e3
        return self._reader_error

    def _build_first(self, table: GraphTable, tm: dict[str, float]) -> GraphLibrary:
        """The library with the template of the first needed key's group built and instantiated
        (need order, `ember.runtime.graphs.need`). Kernel functions are resolved as graphs are
        prepared: this one waits only for its own kernels' images."""
        refs = table.kernels
        functions = KernelFunctions(len(refs), resolve_many=lambda idx: self._functions(table, idx))

        def read_on() -> None:  # the first template is in libember's builder: the reader goes on
            tm["images_at_first_build"] = sum(ev.is_set() for ev in self._handed.values())
            self._rest.set()

        t = time.perf_counter()
        lib = GraphLibrary(table, functions, splicer=self.splicer)
        try:
            lib.build_first(before_build=read_on)
        except FormatError as exc:  # a chunk that does not decode: damaged, not the driver's
            lib.close()
            raise Refused(LOAD, f"archive damaged: {exc}") from exc
        except EmberError as exc:
            lib.close()
            raise Refused(LOAD, f"kernel not found after preload: {exc}") from exc
        except BaseException:
            lib.close()
            raise
        if settings.on("EMBER_DEDICATE"):  # once every template is built and
            # serving starts: built while a cold pod's model still builds (EMBER_DEDICATE_EARLY=1)
            # they slowed that build, and the first token with it: CB engine on H100, medians of 6
            # processes, 15.4 s vs 13.5 s late (`ember bench cb --repeats`)
            early = settings.on("EMBER_DEDICATE_EARLY")
            lib.start_dedicating(after=[] if early else [self._serving])
        tm["templates_first_ms"] = (time.perf_counter() - t) * 1e3
        tm.update(functions_first_ms=functions.resolve_ms, kernels_first=functions.resolved)
        if self.splicer is not None:  # every collective was captured by the regrouping
            tm.update(splice_ms=lib.timings.splice_ms, collective_capture_ms=self.splicer.capture_ms,
                      collectives=len(self.splicer.collectives.table))
        return lib

    def _build_rest(self, lib: GraphLibrary, tm: dict[str, float], *, background: bool) -> None:
        """The other templates (on the background thread, a failure is the launch's to retry:
        the library may be serving already); every key's own exec follows on the library's
        Dedicator thread once they are built and serving started (EMBER_DEDICATE_EARLY=1: once built)."""
        t = time.perf_counter()
        lib.build_rest(raise_errors=not background)
        tm["templates_ms"] = tm.get("templates_first_ms", 0.0) + (time.perf_counter() - t) * 1e3
        lt = lib.timings
        tm.update(
            templates_prepare_ms=lt.prepare_ms,
            templates_build_ms=lt.build_ms,
            templates_instantiate_ms=lt.instantiate_ms,
            templates_native_ms=lt.native_ms,
            templates_upload_ms=lt.upload_ms,
            templates_upload_call_ms=lt.upload_call_ms,
            templates_threads=lt.threads,
            function_attrs_ms=lt.function_attrs_ms,
            functions_ms=lib.functions.resolve_ms,  # every template's kernels, waits included
            kernels_resolved=lib.functions.resolved,
        )
        if failed := lib.failed_templates():
            self.timings["templates_failed"] = "; ".join(failed)
        if lib.unions_refused:
            self.timings["unions_refused"] = lib.unions_refused

    def replay(self) -> None:
        """After the engine's own allocations: release torch's cache, replay the capture window."""
        ip = self.ip
        if div := ip.divergence():
            raise Refused(LOAD, f"allocation sequence diverged from SAVE: {div}")
        t = time.perf_counter()
        self.timings.update(release_cached_memory(ip))
        self.timings["release_cache_ms"] = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        try:
            ip.replay_window()
        except EmberDivergence as exc:
            raise Refused(LOAD, f"allocation sequence diverged from SAVE: {exc}") from exc
        except EmberError as exc:
            raise Refused(LOAD, f"capture window replay failed: {exc}") from exc
        if div := ip.divergence():
            raise Refused(LOAD, f"allocation sequence diverged from SAVE: {div}")
        self.timings["replay_window_ms"] = (time.perf_counter() - t) * 1e3

    def library(self) -> GraphLibrary:
        """The library, as soon as the template of the first needed key's group is instantiated
        (`join_ms` waited for it): the other templates follow on the background thread (a launch
        that comes first waits for its own group's), then every key's own exec (started here,
        as serving starts, unless EMBER_DEDICATE_EARLY=1). Builds them here when there was
        no thread; retries a refused background build once here (the driver may have refused for
        a reason the replay removed); Refused when the archive cannot be restored."""
        t = time.perf_counter()
        if self._thread is not None:
            self._handover.wait()
        self.timings["join_ms"] = (time.perf_counter() - t) * 1e3
        if self._lib is not None:
            self._serving.set()
            return self._lib
        self.wait()
        first = self._error
        if isinstance(first, Refused):
            raise first  # damaged table or a missing kernel: the same on this thread
        if first is not None:
            self.timings["background_error"] = f"{type(first).__name__}: {first}"
        self._error = None
        t = time.perf_counter()
        try:
            self._reconstruct(None, "retry_" if first is not None else "")
        except (RebuildError, EmberError, CudaError) as exc:  # e.g. a driver that drops edge data
            raise Refused(LOAD, f"graphs could not be rebuilt here: {exc}") from exc
        self.timings["foreground_ms"] = (time.perf_counter() - t) * 1e3
        assert self._lib is not None
        self._serving.set()
        return self._lib

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def abandon(self) -> None:
        """A refusal after open(): let the background finish, drop what it built."""
        self.wait()
        if self._lib is not None:
            self._lib.close()  # closes the splicer too
            self._lib = None
        elif self.splicer is not None:
            self.splicer.close()
