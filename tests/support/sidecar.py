"""Shared test helpers for the sidecar tiers: a recording Reporter and metric readers."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from ember_sidecar.metrics import Metrics


class RecordingReporter:
    """A real Reporter that keeps what it was told (the standalone LogReporter, plus events)."""

    def __init__(self) -> None:
        self.results: list[str] = []
        self.events: list[tuple[str, str, str, bool]] = []
        self.engines: list[str] = []

    def result(self, value: str) -> None:
        self.results.append(value)

    def engine(self, value: str) -> None:
        self.engines.append(value)

    def event(self, type_: str, reason: str, message: str, *, deployment: bool = False) -> None:
        self.events.append((type_, reason, message, deployment))


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class ThrottledProxy:
    """A TCP proxy to a real server (MinIO) that can be slowed down or cut off.

    Not a mock: requests reach the real server; the proxy only limits bandwidth (to make a fetch
    last long enough to interrupt) and can refuse connections (an S3 outage).
    """

    def __init__(self, target_host: str, target_port: int, bytes_per_s: float | None = None) -> None:
        import socket

        self.target = (target_host, target_port)
        self.bytes_per_s = bytes_per_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.down = False
        self._conns: list[Any] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        import socket

        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            self._conns += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: Any, dst: Any, throttle: bool) -> None:
        try:
            while not self.down:
                data = src.recv(65536)
                if not data:
                    break
                if throttle and self.bytes_per_s:
                    time.sleep(len(data) / self.bytes_per_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> None:
        """Simulate an outage: drop open connections and refuse new ones."""
        import socket

        self.down = True
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
                c.close()
        self._conns.clear()

    def close(self) -> None:
        self._closed = True
        self.cut()
        with contextlib.suppress(OSError):
            self.listener.close()


def stop_sidecars(procs: list[subprocess.Popen[str]], timeout: float = 20.0) -> None:
    """SIGTERM every sidecar process still running (its graceful shutdown), then kill any that
    outlives `timeout`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
