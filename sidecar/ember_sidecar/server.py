"""The sidecar's one HTTP port: /readyz, /livez, /metrics (Prometheus), /status (JSON).

Standard-library ThreadingHTTPServer in a daemon thread: a handful of probe and scrape requests
a second needs nothing more.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from ember import contract
from ember_sidecar.metrics import Metrics

log = logging.getLogger(__name__)


class HealthServer:
    """Serves probes and metrics for one sidecar."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: Metrics,
        readiness: Callable[[], tuple[bool, str]],
        status: Callable[[], dict[str, Any]],
        alive: Callable[[], bool] = lambda: True,
    ) -> None:

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == contract.METRICS:
                    ok, _ = readiness()
                    metrics.ready.set(1 if ok else 0)
                    self._send(200, metrics.render(), CONTENT_TYPE_LATEST)
                elif path == contract.READYZ:
                    ok, why = readiness()
                    self._send(200 if ok else 503, f"{'ok' if ok else 'not ready'}: {why}\n".encode())
                elif path == contract.LIVEZ:
                    live = alive()
                    self._send(200 if live else 503, b"ok\n" if live else b"dead\n")
                elif path == "/status":
                    self._send(200, json.dumps(status(), default=str).encode(), "application/json")
                else:
                    self._send(404, b"not found\n")

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: quiet
                log.debug("%s " + format, self.address_string(), *args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="ember-http", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
