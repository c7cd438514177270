"""`ember serve` without a GPU: the OpenAI-style HTTP layer over a fake engine, and the start-up
sequence (wait → LOAD or capture → first token → ready) over the real handoff files, including a
real standalone sidecar process handing over a good and a corrupted archive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.serving import http

from ember import handoff
from ember.runtime.adapter import Refused
from ember.serving.http import ByteTokenizer, ServerState, make_server
from ember.serving.startup import EngineStarters, StartupResult, run_startup


class FakeEngine:
    """Deterministic stand-in for CBEngine: token i = (sum(prompt) + 7 i) mod vocab."""

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size
        self.calls: list[tuple[list[int], int]] = []

    def generate(self, prompt_ids: list[int], max_new_tokens: int, timeout: float | None = None) -> list[int]:
        self.calls.append((list(prompt_ids), max_new_tokens))
        return [(sum(prompt_ids) + 7 * i) % self.vocab_size for i in range(max_new_tokens)]


@pytest.fixture
def served() -> Iterator[tuple[ServerState, int, FakeEngine]]:
    engine = FakeEngine()
    state = ServerState(
        model_name="tiny",
        tokenizer=ByteTokenizer(engine.vocab_size),
        engine=engine,
        max_tokens_limit=64,
        max_prompt_tokens=100,
    )
    server = make_server(state, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield state, server.server_address[1], engine
    finally:
        server.shutdown()
        server.server_close()


def test_not_ready_until_startup_finishes(served: tuple[ServerState, int, FakeEngine]) -> None:
    state, port, engine = served
    code, body = http(port, "/health")
    assert code == 503 and body["status"] == "starting"
    code, body = http(port, "/v1/completions", {"prompt": "hi"})
    assert code == 503 and "starting" in body["error"]["message"]
    assert engine.calls == []
    state.startup = StartupResult(mode="restored", graphs=76)
    state.ready.set()
    code, body = http(port, "/health")
    assert code == 200 and body["status"] == "ready" and body["mode"] == "restored" and body["graphs"] == 76


def test_completions_text_and_token_prompts(served: tuple[ServerState, int, FakeEngine]) -> None:
    state, port, engine = served
    state.ready.set()
    code, body = http(port, "/v1/completions", {"model": "tiny", "prompt": "ab", "max_tokens": 3})
    assert code == 200 and body["object"] == "text_completion" and body["model"] == "tiny"
    prompt = ByteTokenizer(engine.vocab_size).encode("ab")
    expected = engine.generate(prompt, 3)
    choice = body["choices"][0]
    assert choice["token_ids"] == expected and choice["finish_reason"] == "length"
    assert choice["text"] == ByteTokenizer(engine.vocab_size).decode(expected)
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    code, body = http(port, "/v1/completions", {"prompt": [[5, 6], [7]], "max_tokens": 2})
    assert code == 200 and [c["token_ids"] for c in body["choices"]] == [[11, 18], [7, 14]]
    code, body = http(port, "/v1/completions", {"prompt": [1, 2, 3]})
    assert code == 200 and len(body["choices"][0]["token_ids"]) == 16  # OpenAI default max_tokens


def test_chat_completions(served: tuple[ServerState, int, FakeEngine]) -> None:
    state, port, engine = served
    state.ready.set()
    code, body = http(
        port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    )
    assert code == 200 and body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and len(body["choices"][0]["token_ids"]) == 4
    sent = engine.calls[-1][0]
    assert ByteTokenizer(engine.vocab_size).decode(sent) == "user: hello\nassistant:"


@pytest.mark.parametrize(
    "path,body,fragment",
    [
        ("/v1/completions", {"prompt": "x", "temperature": 0.7}, "greedy"),
        ("/v1/completions", {"prompt": "x", "stream": True}, "stream"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 65}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "3"}, "max_tokens"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 99999999]}, "token ids"),
        ("/v1/completions", {"prompt": "y" * 101}, "exceeds"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ],
)
def test_bad_requests_get_400_and_do_not_reach_the_engine(
    served: tuple[ServerState, int, FakeEngine], path: str, body: dict[str, Any], fragment: str
) -> None:
    state, port, engine = served
    state.ready.set()
    code, resp = http(port, path, body)
    assert code == 400 and fragment in resp["error"]["message"]
    assert resp["error"]["type"] == "invalid_request_error"
    assert engine.calls == []


def test_invalid_json_unknown_route_and_models(served: tuple[ServerState, int, FakeEngine]) -> None:
    state, port, _ = served
    state.ready.set()
    assert http(port, "/v1/completions", raw=b"{not json")[0] == 400
    assert http(port, "/v1/completions", raw=b"[1]")[0] == 400
    assert http(port, "/v1/embeddings", {"input": "x"})[0] == 404
    code, body = http(port, "/v1/models")
    assert code == 200 and body["data"][0]["id"] == "tiny"


def test_engine_failure_is_a_500_and_the_server_stays_up(served: tuple[ServerState, int, FakeEngine]) -> None:
    state, port, engine = served
    state.ready.set()

    def broken(prompt_ids: list[int], max_new_tokens: int, timeout: float | None = None) -> list[int]:
        raise RuntimeError("engine generation loop stopped")

    engine.generate = broken  # type: ignore[method-assign]
    code, body = http(port, "/v1/completions", {"prompt": "x"})
    assert code == 500 and "generation loop stopped" in body["error"]["message"]
    assert http(port, "/health")[0] == 200


def test_byte_tokenizer_round_trip_and_foreign_ids() -> None:
    tok = ByteTokenizer(32000)
    assert tok.decode(tok.encode("héllo ✓")) == "héllo ✓"
    assert tok.decode([*tok.encode("a"), 5000, *tok.encode("b")]) == "a<5000>b"
    with pytest.raises(ValueError):
        ByteTokenizer(100)


# ---------------------------------------------------------------------------------------------
# Start-up sequence over the handoff files
# ---------------------------------------------------------------------------------------------


class Starters:
    """Records the order of calls; restore behaviour is configurable."""

    def __init__(self, restore_error: Exception | None = None, native_error: Exception | None = None) -> None:
        self.calls: list[str] = []
        self.restore_error, self.native_error = restore_error, native_error
        self.archives: list[Path] = []

    def restore(self, archive_dir: Path) -> tuple[dict[str, Any], dict[str, float]]:
        self.calls.append("restore")
        self.archives.append(archive_dir)
        if self.restore_error is not None:
            raise self.restore_error
        assert (archive_dir / "manifest").is_file()
        return {"graphs": 76}, {"compat": 0.01, "load": 0.2}

    def native(self) -> tuple[dict[str, Any], float]:
        self.calls.append("native")
        if self.native_error is not None:
            raise self.native_error
        return {"graphs": 1}, 1.5

    def first_token(self) -> list[int]:
        self.calls.append("first_token")
        return [42]

    def bundle(self) -> EngineStarters:
        return EngineStarters(self.restore, self.native, self.first_token)


def _reports(run_dir: Path) -> list[dict[str, Any]]:
    return handoff.HandoffWriter(run_dir).new_reports()


def _publish(run_dir: Path, identity: str = "id1") -> Path:
    return _publish_with(handoff.HandoffWriter(run_dir), identity)


def _publish_with(writer: handoff.HandoffWriter, identity: str = "id1") -> Path:
    writer.fetching(identity, "file:///x")
    archive = writer.archive_dir(identity)
    archive.mkdir(parents=True)
    (archive / "manifest").write_text("{}")
    writer.ready(identity, archive)
    return archive


def test_restored_start_reports_every_stage_in_order(tmp_path: Path) -> None:
    archive = _publish(tmp_path)
    s = Starters()
    out = run_startup(s.bundle(), run_dir=tmp_path, deadline=5)
    assert out.mode == "restored" and out.reason == "" and out.graphs == 76 and out.identity == "id1"
    assert s.calls == ["restore", "first_token"] and s.archives == [archive]
    stages = [(r["stage"], r["result"]) for r in _reports(tmp_path)]
    assert stages == [
        ("standby", "ok"),
        ("handoff", "ok"),
        ("compat", "ok"),
        ("load", "ok"),
        ("first_token", "ok"),
        ("ready", "ok"),
    ]
    assert not (tmp_path / handoff.MARKER_FILE).exists()
    assert out.stages["load"] == 0.2 and out.stages["first_token"] >= 0


def test_compat_refusal_falls_back_to_native_capture(tmp_path: Path) -> None:
    _publish(tmp_path)
    s = Starters(restore_error=Refused("compat", "compat: driver archive=575 here=580"))
    out = run_startup(s.bundle(), run_dir=tmp_path, deadline=5)
    assert out.mode == "native" and "driver" in out.reason and s.calls == ["restore", "native", "first_token"]
    reports = _reports(tmp_path)
    compat = next(r for r in reports if r["stage"] == "compat")
    assert compat["result"] == "fallback" and "driver" in compat["reason"]
    assert [r["stage"] for r in reports][-3:] == ["capture", "first_token", "ready"]
    assert not (tmp_path / handoff.MARKER_FILE).exists()


def test_any_load_error_falls_back(tmp_path: Path) -> None:
    _publish(tmp_path)
    s = Starters(restore_error=KeyError("archive lacks 3 of 76 graph keys"))
    out = run_startup(s.bundle(), run_dir=tmp_path, deadline=5)
    assert out.mode == "native" and "KeyError" in out.reason
    load = next(r for r in _reports(tmp_path) if r["stage"] == "load")
    assert load["result"] == "fallback"


def test_sidecar_fallback_and_missing_sidecar_capture_natively(tmp_path: Path) -> None:
    writer = handoff.HandoffWriter(tmp_path / "a")
    writer.fallback("digest-mismatch: blob 1", identity="id1")
    s = Starters()
    out = run_startup(s.bundle(), run_dir=tmp_path / "a", deadline=5)
    assert out.mode == "native" and out.reason.startswith("digest-mismatch") and "restore" not in s.calls
    s2 = Starters()
    t = time.monotonic()
    out2 = run_startup(s2.bundle(), run_dir=tmp_path / "b", deadline=0.3)
    assert time.monotonic() - t < 5
    assert out2.mode == "native" and out2.reason.startswith(handoff.REASON_TIMEOUT)


def test_crash_marker_from_a_previous_engine_means_native(tmp_path: Path) -> None:
    _publish(tmp_path)
    handoff.write_json_atomic(tmp_path / handoff.MARKER_FILE, {"identity": "id1", "pid": 1})
    s = Starters()
    out = run_startup(s.bundle(), run_dir=tmp_path, deadline=5)
    assert out.mode == "native" and handoff.REASON_CRASHED in out.reason and "restore" not in s.calls


def test_direct_archive_and_disabled_handoff(tmp_path: Path) -> None:
    archive = tmp_path / "arch"
    archive.mkdir()
    (archive / "manifest").write_text("{}")
    s = Starters()
    assert run_startup(s.bundle(), run_dir=tmp_path / "run", archive=archive).mode == "restored"
    s2 = Starters()
    out = run_startup(s2.bundle(), run_dir=tmp_path / "run2", use_handoff=False)
    assert out.mode == "native" and out.reason == "handoff disabled"


def test_a_warm_pod_loads_before_its_claim_and_serves_at_once_after_it(tmp_path: Path) -> None:
    """Identity-keyed warm pod: the archive comes before any claim; the engine LOADs, runs one token,
    says ready, waits idle; the claim puts it in service at once, with no engine step in between
    (a token run there would hold the client's first request), timed from the claim."""
    import threading

    writer = handoff.HandoffWriter(tmp_path)
    writer.warm = True
    _publish_with(writer)
    s, box = Starters(), dict[str, Any]()

    def start() -> None:
        box["out"] = run_startup(s.bundle(), run_dir=tmp_path, deadline=5)

    thread = threading.Thread(target=start)
    thread.start()
    deadline = time.monotonic() + 10
    while (handoff.read_engine_state(tmp_path) or {}).get("state") != "ready" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handoff.read_engine_state(tmp_path)["state"] == "ready"
    time.sleep(0.2)
    assert thread.is_alive() and s.calls == ["restore", "first_token"]  # idle, not in service
    assert "ready" not in [r["stage"] for r in _reports(tmp_path)]
    writer.in_service(time.time())
    thread.join(10)
    out = box["out"]
    assert out.mode == "restored" and s.calls == ["restore", "first_token"]  # nothing after the claim
    assert out.stages["warm_wait"] >= 0.2 and out.stages["first_token"] < 5  # from the claim, not the start
    assert [r["stage"] for r in _reports(tmp_path)][-2:] == ["first_token", "ready"]


def test_the_engine_state_follows_the_start(tmp_path: Path) -> None:
    """loading → ready on a cold start; failed, with the reason, when the start fails."""
    _publish(tmp_path / "a")
    run_startup(Starters().bundle(), run_dir=tmp_path / "a", deadline=5)
    assert handoff.read_engine_state(tmp_path / "a")["state"] == "ready"
    s = Starters(native_error=MemoryError("no room for the KV cache"))
    with pytest.raises(MemoryError):
        run_startup(s.bundle(), run_dir=tmp_path / "b", use_handoff=False)
    failed = handoff.read_engine_state(tmp_path / "b")
    assert failed["state"] == "failed" and "KV cache" in failed["reason"]


def test_native_failure_is_reported_and_raised(tmp_path: Path) -> None:
    s = Starters(native_error=MemoryError("no room for the KV cache"))
    with pytest.raises(MemoryError):
        run_startup(s.bundle(), run_dir=tmp_path, use_handoff=False)
    capture = next(r for r in _reports(tmp_path) if r["stage"] == "capture")
    assert capture["result"] == "failed" and "KV cache" in capture["reason"]


# ---------------------------------------------------------------------------------------------
# With the real standalone sidecar process
# ---------------------------------------------------------------------------------------------


def _sidecar(run_dir: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ember_sidecar.main",
            "--run-dir",
            str(run_dir),
            "--port",
            "0",
            "--host",
            "127.0.0.1",
            "--standalone",
            *args,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait(pred: Callable[[], Any], timeout: float = 20.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := pred():
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def _sidecar_ready(run_dir: Path) -> tuple[int, str]:
    port = int(_wait(lambda: (run_dir / "sidecar.port").is_file() and (run_dir / "sidecar.port").read_text()))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize("corrupt", [False, True])
def test_with_standalone_sidecar(tmp_path: Path, corrupt: bool) -> None:
    from ember.store import LocalStore
    from ember_testing.archives import write_blob_archive

    store = LocalStore(tmp_path / "store")
    m = write_blob_archive(store, [4096, 70_000])
    if corrupt:
        blob = store.root / "blobs" / m.blobs[1].sha256
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, one bit pattern off: only the digest can tell
        blob.write_bytes(bytes(data))
    run_dir = tmp_path / "run"
    proc = _sidecar(run_dir, "--store", store.uri, "--identity", m.identity_hash)
    try:
        s = Starters()
        out = run_startup(s.bundle(), run_dir=run_dir, deadline=20)
        if corrupt:
            assert (
                out.mode == "native" and out.reason.startswith("digest-mismatch") and "restore" not in s.calls
            )
        else:
            assert out.mode == "restored" and out.identity == m.identity_hash
            assert s.archives[0].name == m.identity_hash
        code, _ = _wait(lambda: (r := _sidecar_ready(run_dir))[0] == 200 and r)
        assert code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, log
    assert ("Restore result: restored" in log) != corrupt, log


def test_first_launch_failure_of_restored_graphs_keeps_the_crash_marker(tmp_path: Path) -> None:
    _publish(tmp_path)
    s = Starters()

    def dies() -> list[int]:
        raise RuntimeError("CUDA error: an illegal instruction was encountered")

    starters = EngineStarters(s.restore, s.native, dies)
    with pytest.raises(RuntimeError, match="illegal instruction"):
        run_startup(starters, run_dir=tmp_path, deadline=5)
    assert (tmp_path / handoff.MARKER_FILE).exists()
    # The next engine in this pod captures natively instead of loading again.
    s2 = Starters()
    out = run_startup(s2.bundle(), run_dir=tmp_path, deadline=5)
    assert out.mode == "native" and handoff.REASON_CRASHED in out.reason and "restore" not in s2.calls
