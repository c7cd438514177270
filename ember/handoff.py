"""The sidecar ↔ engine handoff: a verified archive and a few small JSON files in a shared volume.

Both sides of the protocol live here. The sidecar (``ember_sidecar``) fetches and verifies the
archive, then publishes it; the engine process (``ember.runtime``, ``ember.serving.server`` or a vLLM
plugin) waits for it, LOADs or captures natively, and reports each stage back. No sockets, no
daemons: files in ``EMBER_RUN_DIR`` (default ``/var/run/ember``, an emptyDir shared by the engine
and sidecar containers, which outlives container restarts but not the pod). The names are the pod
contract's (``ember.contract``)::

    <run_dir>/status.json                  written by the sidecar (atomic replace)
    <run_dir>/store/                       a local store (same layout as ember.store), the cache:
        blobs/<sha256>                     verified blobs (as stored: zstd), shared by archives
        archives/<identity-hash>/manifest  written last, after every blob is verified
    <run_dir>/reports/<ns>-<pid>-<stage>.json   one file per engine report (atomic, never rewritten)
    <run_dir>/load-attempt.json            crash-safety marker, present while the engine LOADs
    <run_dir>/engine-state.json            written by the engine: loading | ready | failed

``status.json`` states: ``unclaimed`` (warm pod, no claim yet), ``fetching`` (claim observed),
``ready`` (archive verified and in place: LOAD it), ``fallback`` (capture natively; ``reason``
says why). ``ready`` and ``fallback`` are final for a given claim. Every state carries ``warm``:
true on an identity-keyed warm pod, whose sidecar hands the archive off before the claim (the pod
carries the hand-off data from its creation); it turns false, with ``claimed_at``, when the claim
puts the pod into service.

A warm engine (identity-keyed pool) LOADs as soon as it gets the archive, then says it is loaded
and idle and waits for the claim::

    result = handoff.wait_for_archive(deadline=None)     # returns before any claim on a warm pod
    handoff.engine_loading(result)
    ...                                                   # build, LOAD, allocate the KV cache
    handoff.engine_ready(result)                          # the operator may claim this pod now
    claim = handoff.wait_for_claim(result.run_dir)        # in service (claim → first token clock)

Engine side, the whole workflow::

    from ember import handoff

    result = handoff.wait_for_archive(deadline=30.0)    # blocks; never raises on protocol trouble
    if result.archive_dir is not None:
        with handoff.load_attempt(result):               # marker: a crash here → next start falls back
            ok = my_runtime.load(result.archive_dir)      # compat check + LOAD (report each stage)
    ...
    handoff.report("ready", seconds, "ok")               # sidecar's /readyz turns true

If the engine dies inside ``load_attempt`` (segfault, OOM kill), the marker stays behind; the next
``wait_for_archive`` in this pod returns a fallback with reason ``engine-crashed-during-load``
instead of trying again, so a bad archive can never cause a crash loop.

What this module deliberately does not do: fetch, verify or interpret archives (the sidecar and
``ember.archive`` do), check the compatibility key (the engine runtime does, with the real GPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.contract import (
    CACHE_DIR,
    ENGINE_FAILED,
    ENGINE_LOADING,
    ENGINE_READY,
    ENGINE_STATE_FILE,
    ENV_RUN_DIR,
    MARKER_FILE,
    REPORTS_DIR,
    RUN_DIR,
    STATUS_FILE,
)

# Sidecar states.
UNCLAIMED, FETCHING, READY, FALLBACK = "unclaimed", "fetching", "ready", "fallback"
FINAL_STATES = frozenset({READY, FALLBACK})

# Stages the engine reports (the sidecar turns them into metrics): "handoff" is reported by
# wait_for_archive itself; "compat", "load", "capture" (native), "first_token", "standby" (warm pod
# with weights loaded, waiting for a claim) and "ready" (taking requests) by the engine.
ENGINE_STAGES = ("handoff", "compat", "load", "capture", "first_token", "standby", "ready")

# Fallback reasons named by the engine side.
REASON_CRASHED = "engine-crashed-during-load"
REASON_TIMEOUT = "handoff-timeout"
REASON_NO_SIDECAR = "no-sidecar"


def run_dir_from_env(run_dir: str | os.PathLike[str] | None = None) -> Path:
    """The run directory: the argument, else ``EMBER_RUN_DIR``, else ``/var/run/ember``."""
    return Path(run_dir or os.environ.get(ENV_RUN_DIR) or RUN_DIR)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON so readers see the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when absent or unreadable (treated as absent)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ---------------------------------------------------------------------------------------------
# Engine side
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HandoffResult:
    """What the engine gets: an archive to LOAD, or None and the reason to capture natively."""

    archive_dir: Path | None
    reason: str = ""
    identity: str = ""
    waited_s: float = 0.0
    run_dir: Path = field(default_factory=run_dir_from_env)
    rank: int = 0  # the rank layout of the claim (ember.dev/rank, ember.dev/world)
    world: int = 1
    engine_args: tuple[str, ...] = ()  # the claim's extra engine arguments (ember.dev/engine-args)
    claimed_at: float = 0.0  # wall time of the claim (a warm pod's clock starts there), 0 if none
    warm: bool = False  # handed off before any claim (identity-keyed warm pod): see wait_for_claim

    @property
    def restored(self) -> bool:
        """True when there is a verified archive to LOAD."""
        return self.archive_dir is not None

    @property
    def manifest_path(self) -> Path | None:
        return None if self.archive_dir is None else self.archive_dir / "manifest"

    @property
    def store_uri(self) -> str:
        """The verified cache as a store URI: ``ember.store.open_store(result.store_uri)``."""
        return (self.run_dir / CACHE_DIR).absolute().as_uri()

    def blob_path(self, digest: str) -> Path:
        """Where a verified blob of the archive lies (stored bytes, as named in the manifest)."""
        return self.run_dir / CACHE_DIR / "blobs" / digest


def wait_for_archive(
    run_dir: str | os.PathLike[str] | None = None,
    deadline: float | None = 30.0,
    *,
    claim_timeout: float | None = None,
    poll_s: float = 0.02,
    report_handoff: bool = True,
) -> HandoffResult:
    """Block until the sidecar hands over a verified archive or says to capture natively.

    ``deadline``: seconds to wait for the archive, counted from the claim (the sidecar's
    ``claimed_at``) or from this call, whichever is later; None waits forever. While the sidecar
    says ``unclaimed`` (a warm pod) the wait is for the claim itself, bounded by ``claim_timeout``
    (None = wait for a claim forever, the right thing for a warm pod). With no status file at all
    (no sidecar) the deadline counts from this call. Never raises for protocol problems: every
    outcome is a HandoffResult; ``archive_dir`` is None exactly when the engine must capture.
    """
    root = run_dir_from_env(run_dir)
    start_wall, start = time.time(), time.monotonic()
    marker = read_json(root / MARKER_FILE)
    if marker is not None:
        reason = f"{REASON_CRASHED}: a previous engine died while loading {marker.get('identity', '?')}"
        report("load", 0.0, "fallback", reason, run_dir=root)
        return HandoffResult(None, reason, str(marker.get("identity", "")), 0.0, root)

    while True:
        status = read_json(root / STATUS_FILE)
        now_wall = time.time()
        if status is not None and status.get("state") in FINAL_STATES:
            return _result_from_status(root, status, time.monotonic() - start, report_handoff)
        if status is not None and status.get("state") == UNCLAIMED:
            if claim_timeout is not None and time.monotonic() - start > claim_timeout:
                return HandoffResult(None, f"{REASON_TIMEOUT}: no claim within {claim_timeout:g}s",
                                     "", time.monotonic() - start, root)
        elif deadline is not None:
            claimed_at = float(status.get("claimed_at") or 0.0) if status else 0.0
            since = now_wall - max(start_wall, claimed_at)
            if since > deadline:
                why = "no sidecar status" if status is None else f"sidecar still {status.get('state')!r}"
                reason = f"{REASON_TIMEOUT}: {why} after {deadline:g}s"
                report("handoff", time.monotonic() - start, "fallback", reason, run_dir=root)
                return HandoffResult(None, reason, str((status or {}).get("identity", "")),
                                     time.monotonic() - start, root)
        time.sleep(poll_s)


def _result_from_status(
    root: Path, status: dict[str, Any], waited: float, report_handoff: bool
) -> HandoffResult:
    identity = str(status.get("identity", ""))
    args = tuple(str(a) for a in status.get("engine_args") or ())
    claimed_at = float(status.get("claimed_at") or 0.0)
    if status["state"] == FALLBACK:
        return HandoffResult(None, str(status.get("reason") or "fallback"), identity, waited, root,
                             engine_args=args, claimed_at=claimed_at, warm=bool(status.get("warm")))
    archive_dir = Path(str(status.get("archive_dir", "")))
    if not archive_dir.is_absolute():
        archive_dir = root / archive_dir
    if not (archive_dir / "manifest").is_file():
        reason = f"archive-missing: {archive_dir} has no manifest"
        report("handoff", waited, "fallback", reason, run_dir=root)
        return HandoffResult(None, reason, identity, waited, root, engine_args=args, claimed_at=claimed_at)
    if report_handoff:
        # Time from the sidecar publishing the archive to the engine picking it up.
        published = float(status.get("updated_at") or time.time())
        report("handoff", max(0.0, time.time() - published), "ok", run_dir=root)
    return HandoffResult(archive_dir, "", identity, waited, root, int(status.get("rank") or 0),
                         int(status.get("world") or 1), args, float(status.get("claimed_at") or 0.0),
                         bool(status.get("warm")))


def report(
    stage: str,
    seconds: float,
    result: str = "ok",
    reason: str = "",
    *,
    run_dir: str | os.PathLike[str] | None = None,
    **extra: Any,
) -> Path | None:
    """Tell the sidecar how a stage went: ``result`` is ``ok``, ``fallback`` or ``failed``.

    ``stage`` is one of ENGINE_STAGES (others are accepted and recorded but not graphed).
    ``compat``/``load`` with result ``fallback`` make the sidecar record a fallback with ``reason``;
    ``ready`` makes its readiness probe pass. Never raises: a report that cannot be written is
    dropped (returns None), because reporting must not take serving down.
    """
    root = run_dir_from_env(run_dir)
    entry = {"stage": stage, "seconds": float(seconds), "result": result, "reason": reason,
             "at": time.time(), "pid": os.getpid(), **extra}
    path = root / REPORTS_DIR / f"{time.time_ns():020d}-{os.getpid()}-{stage}.json"
    try:
        write_json_atomic(path, entry)
    except OSError:
        return None
    return path


def write_engine_state(
    state: str, reason: str = "", *, identity: str = "", run_dir: str | os.PathLike[str] | None = None,
    **info: Any,
) -> Path | None:
    """Say what the engine is doing: ENGINE_LOADING, ENGINE_READY (loaded and idle: a warm pod may
    be claimed) or ENGINE_FAILED (with ``reason``: the operator replaces a warm pod saying so).
    The sidecar mirrors it onto the pod (``ember.dev/engine``). Never raises (None when it could
    not be written)."""
    if state not in (ENGINE_LOADING, ENGINE_READY, ENGINE_FAILED):
        raise ValueError(f"engine state {state!r} is not one of loading, ready, failed")
    root = run_dir_from_env(run_dir)
    entry = {"state": state, "reason": reason, "identity": identity, "pid": os.getpid(),
             "at": time.time(), **info}
    try:
        write_json_atomic(root / ENGINE_STATE_FILE, entry)
    except OSError:
        return None
    return root / ENGINE_STATE_FILE


def engine_loading(result: HandoffResult | None = None, **info: Any) -> Path | None:
    """The engine started building (weights, LOAD or capture, KV cache)."""
    return _engine_state(ENGINE_LOADING, "", result, info)


def engine_ready(result: HandoffResult | None = None, **info: Any) -> Path | None:
    """Loaded and idle: a warm pod is claimable, a claimed one answers at once (``info``: e.g. the
    GPU memory held, the mode)."""
    return _engine_state(ENGINE_READY, "", result, info)


def engine_failed(reason: str, result: HandoffResult | None = None, **info: Any) -> Path | None:
    """The engine cannot serve (a warm pod saying so is replaced); ``reason`` short and plain."""
    return _engine_state(ENGINE_FAILED, reason, result, info)


def _engine_state(state: str, reason: str, result: HandoffResult | None, info: dict[str, Any]) -> Path | None:
    if result is None:
        return write_engine_state(state, reason, **info)
    return write_engine_state(state, reason, identity=result.identity, run_dir=result.run_dir, **info)


def read_engine_state(run_dir: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The engine's last state (see write_engine_state), or None when it wrote none."""
    return read_json(run_dir_from_env(run_dir) / ENGINE_STATE_FILE)


@dataclass(frozen=True)
class InService:
    """The claim put the pod into service: ``claimed_at`` (the operator's stamp, else when the
    sidecar saw the claim; epoch seconds) and how long the engine waited for it."""

    claimed_at: float
    waited_s: float


def wait_for_claim(
    run_dir: str | os.PathLike[str] | None = None, timeout: float | None = None, *, poll_s: float = 0.02,
) -> InService | None:
    """Block until the pod is in service: at once on a claimed or cold pod (the status has no
    ``warm`` flag, or it is false), on a warm pod when the claim arrives. None when ``timeout``
    seconds pass first (None: wait forever, a warm pod's normal case)."""
    root = run_dir_from_env(run_dir)
    start = time.monotonic()
    while True:
        status = read_json(root / STATUS_FILE)
        if status is not None and status.get("state") != UNCLAIMED and not status.get("warm"):
            return InService(float(status.get("claimed_at") or 0.0), time.monotonic() - start)
        if timeout is not None and time.monotonic() - start > timeout:
            return None
        time.sleep(poll_s)


class LoadAttempt:
    """The crash marker: a LOAD (and its first launches) in progress. `begin()` writes it, `done()`
    removes it; a process death in between leaves it, and the next `wait_for_archive` in the pod
    falls back (``engine-crashed-during-load``) instead of loading again. As a context manager,
    leaving normally or by a Python exception (which the caller handles by capturing) is done()."""

    def __init__(self, run_dir: Path, identity: str, **fields: Any) -> None:
        self.path, self.identity, self.fields = run_dir / MARKER_FILE, identity, fields

    def begin(self) -> LoadAttempt:
        marker = {"identity": self.identity, "pid": os.getpid(), "started_at": time.time()}
        write_json_atomic(self.path, {**marker, **{k: str(v) for k, v in self.fields.items()}})
        return self

    def done(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __enter__(self) -> LoadAttempt:
        return self.begin()

    def __exit__(self, *exc: object) -> None:
        self.done()


def load_attempt(
    result: HandoffResult | None = None, *, run_dir: str | os.PathLike[str] | None = None, identity: str = "",
    **fields: Any,
) -> LoadAttempt:
    """The one crash marker of every engine: for a hand-off `result`, or a run directory (default
    EMBER_RUN_DIR, else the pod contract's) and an identity (a LOAD without a sidecar)."""
    if result is not None:
        return LoadAttempt(result.run_dir, result.identity, archive_dir=result.archive_dir, **fields)
    return LoadAttempt(run_dir_from_env(run_dir), identity, **fields)


def archive_location(archive_dir: str | os.PathLike[str]) -> tuple[str, str]:
    """(store URI, identity hash) of an archive directory in the cache layout
    `<store>/archives/<identity hash>` (the sidecar's cache, a local store); ValueError otherwise."""
    path = Path(archive_dir).absolute()
    if path.name == "manifest":
        path = path.parent
    if path.parent.name != "archives":
        raise ValueError(f"{archive_dir} is not <store>/archives/<identity-hash>")
    return path.parent.parent.as_uri(), path.name


# ---------------------------------------------------------------------------------------------
# Sidecar side
# ---------------------------------------------------------------------------------------------


@dataclass
class HandoffWriter:
    """The sidecar's half: publish state and collect the engine's reports, in one run directory."""

    run_dir: Path
    _seen: set[str] = field(default_factory=set)
    _claimed_at: float = 0.0
    warm: bool = False  # an identity-keyed warm pod before its claim (every state says so)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        (self.run_dir / REPORTS_DIR).mkdir(parents=True, exist_ok=True)

    @property
    def cache_dir(self) -> Path:
        """The local store holding verified archives (``<run_dir>/store``)."""
        return self.run_dir / CACHE_DIR

    def archive_dir(self, identity: str) -> Path:
        return self.cache_dir / "archives" / identity

    def status(self) -> dict[str, Any] | None:
        return read_json(self.run_dir / STATUS_FILE)

    def _write(self, state: str, **fields: Any) -> None:
        data = {"state": state, "updated_at": time.time(), "claimed_at": self._claimed_at,
                "warm": self.warm, **fields}
        write_json_atomic(self.run_dir / STATUS_FILE, data)

    def in_service(self, claimed_at: float | None = None) -> None:
        """The claim put a warm pod into service: the current state again, with ``warm`` false and
        the claim's time (the engine's wait_for_claim returns)."""
        self.warm = False
        self._claimed_at = claimed_at or time.time()
        current = self.status() or {"state": UNCLAIMED}
        fields = {k: v for k, v in current.items() if k not in ("state", "updated_at", "claimed_at", "warm")}
        self._write(str(current.get("state") or UNCLAIMED), **fields)

    def engine_state(self) -> dict[str, Any] | None:
        """The engine's own state file (ENGINE_STATE_FILE), or None."""
        return read_json(self.run_dir / ENGINE_STATE_FILE)

    def unclaimed(self) -> None:
        """Warm pod: no claim yet (engine keeps waiting without a deadline)."""
        self._write(UNCLAIMED)

    def fetching(self, identity: str, archive_uri: str, claimed_at: float | None = None) -> None:
        """Claim observed: the engine's deadline (and its claim → first token clock) starts at
        `claimed_at` (the operator's stamp), else now; on a warm pod (`warm`) at the claim that
        puts it into service (`in_service`)."""
        self._claimed_at = 0.0 if self.warm else (claimed_at or time.time())
        self._write(FETCHING, identity=identity, archive=archive_uri)

    def ready(
        self, identity: str, archive_dir: Path, archive_uri: str = "", rank: int = 0, world: int = 1,
        engine_args: tuple[str, ...] = (),
    ) -> None:
        """The verified archive is in place: the engine LOADs it (as `rank` of `world`), started
        with the claim's extra `engine_args`."""
        self._write(READY, identity=identity, archive_dir=str(archive_dir), archive=archive_uri,
                    rank=rank, world=world, engine_args=list(engine_args))

    def fallback(
        self, reason: str, identity: str = "", archive_uri: str = "", engine_args: tuple[str, ...] = ()
    ) -> None:
        """Capture natively; ``reason`` is short and machine-friendly (e.g. ``digest-mismatch: ...``)."""
        self._write(FALLBACK, reason=reason, identity=identity, archive=archive_uri,
                    engine_args=list(engine_args))

    def load_marker(self) -> dict[str, Any] | None:
        """The crash-safety marker, if an engine is loading now or died while loading."""
        return read_json(self.run_dir / MARKER_FILE)

    def new_reports(self) -> list[dict[str, Any]]:
        """Engine reports not returned before, oldest first."""
        try:
            names = sorted(n for n in os.listdir(self.run_dir / REPORTS_DIR) if n.endswith(".json"))
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if name in self._seen:
                continue
            entry = read_json(self.run_dir / REPORTS_DIR / name)
            if entry is None:
                continue
            self._seen.add(name)
            out.append(entry)
        return out
