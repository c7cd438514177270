"""`ember-sidecar`: the sidecar process (one entry point, settings from env, flags override).

In a pod it watches its own pod for the operator's claim; with `--standalone` (no Kubernetes)
the claim comes from `--archive MANIFEST_URI` or `--store URI --identity HASH`, which makes it
easy to drive from a script next to an engine:

    ember-sidecar --standalone --store s3://bucket/prefix --identity <hash> --run-dir /tmp/run &
    python -m my_engine   # ember.handoff.wait_for_archive("/tmp/run") → LOAD or capture

It exits 0 when the pod is deleted or on SIGTERM/SIGINT (fetches cancelled, partial files
removed); restore failures never end it (they become fallbacks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ember import contract
from ember.contract import Claim
from ember.handoff import HandoffWriter
from ember_sidecar.claims import manifest_identity
from ember_sidecar.fetching import ArchiveCache
from ember_sidecar.metrics import Metrics
from ember_sidecar.reporting import KubeReporter, LogReporter, Reporter
from ember_sidecar.restoring import Restorer
from ember_sidecar.server import HealthServer
from ember_sidecar.settings import Settings

log = logging.getLogger("ember_sidecar")


def _kube_client(settings: Settings) -> Any:
    from kubernetes import client, config

    if settings.kubeconfig or not os.environ.get("KUBERNETES_SERVICE_HOST"):
        return config.new_client_from_config(config_file=settings.kubeconfig)
    config.load_incluster_config()
    return client.ApiClient()


def run(settings: Settings, stop: threading.Event | None = None) -> int:
    """Run the sidecar until `stop` is set or the pod is gone. Returns the exit code."""
    stop = stop or threading.Event()
    writer = HandoffWriter(settings.run_dir)
    cache = ArchiveCache(writer.cache_dir, **settings.cache_options())
    cache.clean_partials()  # a previous sidecar container may have died mid-fetch
    if settings.store:
        cache.warm(settings.store)  # the pool's store (EMBER_STORE): client ready before a claim
    metrics = Metrics()
    api_client: Any = None
    reporter: Reporter
    if settings.standalone:
        reporter = LogReporter()
    else:
        if not settings.pod_name:
            log.error("EMBER_POD_NAME (or POD_NAME) is not set: pass it from the downward API, "
                      "or run with --standalone")
            return 2
        api_client = _kube_client(settings)
        reporter = KubeReporter(api_client, settings.namespace, settings.pod_name)
    restorer = Restorer(cache, writer, metrics, reporter, engine_timeout_s=settings.engine_timeout_s,
                        warm_ready_without_engine=settings.warm_ready_without_engine)
    server = HealthServer(settings.host, settings.port, metrics, restorer.readiness, restorer.snapshot)
    server.start()
    log.info("Sidecar started: run dir %s, HTTP on %s:%d, %s", settings.run_dir, settings.host, server.port,
             "standalone" if settings.standalone else f"pod {settings.namespace}/{settings.pod_name}")
    with contextlib.suppress(OSError):  # lets scripts find the port when started with --port 0
        (settings.run_dir / contract.SIDECAR_PORT_FILE).write_text(str(server.port))
    _start_thread(_poll_engine, restorer, stop, name="ember-engine-poll")

    if settings.standalone:
        if not _claim_standalone(settings, restorer):
            server.close()
            return 2
    else:
        assert isinstance(reporter, KubeReporter)
        _watch_own_pod(settings, api_client, reporter, restorer, stop)

    while not stop.wait(0.5):
        pass
    removed = restorer.stop()
    server.close()
    log.info("Sidecar stopped (%d partial files removed)", removed)
    return 0


def _start_thread(fn: Any, *args: Any, name: str) -> None:
    threading.Thread(target=fn, args=args, name=name, daemon=True).start()


def _poll_engine(restorer: Restorer, stop: threading.Event) -> None:
    """Engine reports → metrics, results, readiness; every 50 ms until stopped."""
    while not stop.is_set():
        try:
            restorer.poll_engine()
        except Exception:
            log.exception("Polling engine reports failed")
        stop.wait(0.05)


def _claim_standalone(settings: Settings, restorer: Restorer) -> bool:
    """No Kubernetes: the claim comes from the settings. False when they name no archive."""
    archive = settings.standalone_archive()
    identity = settings.identity or manifest_identity(archive) or ""
    if not archive or not identity:
        log.error("Standalone mode needs --archive MANIFEST_URI or --store URI --identity HASH")
        return False
    restorer.claim(Claim(archive, identity))
    return True


def _watch_own_pod(
    settings: Settings, api_client: Any, reporter: KubeReporter, restorer: Restorer, stop: threading.Event
) -> None:
    """Every version of this pod goes to the restorer (claims, prefetch); its deletion stops us."""
    from ember_sidecar.watching import PodWatcher

    def on_pod(pod: dict[str, Any], observed_at: float) -> None:
        reporter.update_pod(pod)
        meta = pod.get("metadata") or {}
        restorer.on_annotations(meta.get("annotations") or {}, observed_at, meta.get("labels") or {})

    def on_gone(why: str) -> None:
        log.info("Pod %s/%s is %s: stopping", settings.namespace, settings.pod_name, why)
        stop.set()

    watcher = PodWatcher(api_client, settings.namespace, settings.pod_name, on_pod, on_gone, stop)
    _start_thread(watcher.run, name="ember-pod-watch")


cli = typer.Typer(add_completion=False)


@cli.command()
def _main(
    standalone: Annotated[bool, typer.Option(help="No Kubernetes: claim from flags.")] = False,
    archive: Annotated[str | None, typer.Option(help="Manifest URI (…/archives/<hash>/manifest).")] = None,
    store: Annotated[str | None, typer.Option(help="Store URI (with --identity).")] = None,
    identity: Annotated[str | None, typer.Option(help="Identity hash (with --store).")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="Shared run directory (EMBER_RUN_DIR).")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port for probes and metrics (0 = any).")] = None,
    host: Annotated[str | None, typer.Option(help="HTTP bind address (EMBER_SIDECAR_HOST).")] = None,
    s3_endpoint: Annotated[str | None, typer.Option(help="S3 endpoint URL (EMBER_S3_ENDPOINT).")] = None,
) -> None:
    """Claim, fetch and verify a graph archive and hand it to the engine (see docs/sidecar.md)."""
    settings = Settings.from_env(standalone=standalone or None, archive=archive, store=store,
                                 identity=identity, run_dir=run_dir, port=port, host=host,
                                 s3_endpoint=s3_endpoint)
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    code = run(settings, stop)
    # Threads still running now must not outlive the interpreter's finalization: an S3 download
    # in flight (non-daemon transfer threads; its partial file is already removed) would be waited
    # for, and a daemon thread (the pod watch blocked in its stream) that logs while the
    # interpreter finalizes aborts the process (SIGABRT, seen once in tests/k8s). Nothing is left
    # to clean up, so such an exit skips finalization.
    deadline = time.monotonic() + 1.0
    for t in threading.enumerate():
        if t is not threading.main_thread():
            t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threading.enumerate() if t is not threading.main_thread()):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise typer.Exit(code)


def main() -> None:
    """Console script entry point (`ember-sidecar`)."""
    cli()


if __name__ == "__main__":
    main()
