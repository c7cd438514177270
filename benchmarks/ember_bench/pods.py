"""The pods of the warm-pod benches (`ember bench vllm-warm`, `ember bench cb-warm`), whatever the
engine: the GPU's memory from outside every process (nvidia-smi), the OpenAI-style requests a
client makes (first token retried while refused, greedy tokens), the hand-off written as the
sidecar writes it, and one pod's engine process driven cold (claimed at its start) or warm
(engine ready, idle, then the claim) with its figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ember import contract, handoff

PROMPT = list(range(101, 133))  # token ids (no tokenizer): the client's first request


def ember_argv(*args: str) -> list[str]:
    """`ember <args>` with this interpreter (no console script needed, no CUDA import here)."""
    run = "import sys; from ember.cli import app; sys.argv[0] = 'ember'; app()"
    return [sys.executable, "-c", run, *args]


# What an engine adds to a run's figures once it serves (e.g. its /health): (port, result).
Describe = Callable[[int, dict[str, Any]], None]


# ---------------------------------------------------------------------------------------------
# GPU memory
# ---------------------------------------------------------------------------------------------


def parse_smi(text: str) -> list[int]:
    """`nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits` → MiB per GPU line."""
    out = []
    for line in text.splitlines():
        head = line.split(",")[0].strip()
        if head.isdigit():
            out.append(int(head))
    return out


def gpu_index(given: str = "") -> str:
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "").split(",")[0].strip()
    return given or first or "0"


def gpu_used_mib(index: str) -> int | None:
    """memory.used of the GPU, from outside every process (nvidia-smi); None when unreadable."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              "-i", index], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = parse_smi(out.stdout)
    return used[0] if used else None


def gpu_facts(index: str) -> dict[str, Any]:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired, ValueError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits",
                              "-i", index], capture_output=True, text=True, timeout=20, check=False)
        name, total = out.stdout.strip().splitlines()[0].rsplit(",", 1)
        return {"index": index, "name": name.strip(), "total_mib": int(total)}
    return {"index": index, "name": "unknown"}


def parse_apps(text: str) -> dict[int, int]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` → MiB per pid."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = out.get(int(parts[0]), 0) + int(parts[1])
    return out


def process_tree(pid: int, proc_root: Path = Path("/proc")) -> set[int]:
    """`pid` and every process below it (vLLM's engine core is a child of the API server)."""
    children: dict[int, list[int]] = {}
    for stat in proc_root.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the name field may hold spaces and parentheses: the ppid is the 2nd field after its last ')'
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in tree:
            tree.add(p)
            todo += children.get(p, [])
    return tree


def pod_used_mib(pid: int, index: str) -> int | None:
    """GPU memory of the pod's own processes (nvidia-smi's per-process figures, contexts included),
    blind to other users of the GPU; None when nvidia-smi lists none of them."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits", "-i", index],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    apps, tree = parse_apps(out.stdout), process_tree(pid)
    mine = [mib for p, mib in apps.items() if p in tree]
    return sum(mine) if mine else None


def samples(index: str, n: int = 5, every_s: float = 0.5, pid: int | None = None) -> list[int]:
    """memory.used of the GPU n times; with `pid`, that process tree's own use instead."""
    out = []
    for i in range(n):
        if i:
            time.sleep(every_s)
        used = gpu_used_mib(index) if pid is None else pod_used_mib(pid, index)
        if used is not None:
            out.append(used)
    return out


# ---------------------------------------------------------------------------------------------
# HTTP, as a client
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(port: int, path: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return int(exc.code), {"error": exc.read()[:500].decode(errors="replace")}


def get(port: int, path: str, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return int(r.status), json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return int(exc.code), {"error": exc.read()[:500].decode(errors="replace")}


def served_model(port: int) -> str:
    return str(get(port, "/v1/models")[1]["data"][0]["id"])


def first_token(port: int, model: str, timeout: float, proc: subprocess.Popen[bytes] | None = None
                ) -> tuple[float, int]:
    """One completion (max_tokens 1), retried while refused or unreachable (and `proc` lives): (the
    wall time it came back, the refusals before it)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    refusals, end = 0, time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"ember serve exited {proc.returncode} before the first token "
                               f"({refusals} refusals)")
        try:
            status, _ = post(port, "/v1/completions", body, timeout)
        except OSError:
            status = 0
        if status == 200:
            return time.time(), refusals
        refusals += 1
        time.sleep(0.01)
    raise TimeoutError(f"no first token within {timeout:.0f} s ({refusals} refusals)")


def greedy(port: int, model: str) -> tuple[list[Any] | None, str]:
    """16 greedy token ids (`token_ids` of the choice: ember serve's, vLLM's with return_token_ids;
    else vLLM's logprobs' tokens as `token_id:N`; without a tokenizer the text says nothing), or
    None and why. Fields an engine does not know it ignores."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    status, out = post(port, "/v1/completions", body)
    if status != 200:
        return None, f"HTTP {status}: {out}"
    choice = (out.get("choices") or [{}])[0]
    ids = choice.get("token_ids") or (choice.get("logprobs") or {}).get("tokens")
    return (list(ids), "") if ids else (None, f"no token ids in {str(choice)[:300]}")


# ---------------------------------------------------------------------------------------------
# The sidecar's half and the engine process
# ---------------------------------------------------------------------------------------------


def hand_off(w: handoff.HandoffWriter, run: str, identity: str, archive_dir: Path,
             engine_args: tuple[str, ...], claimed_at: float) -> None:
    """What the sidecar writes: a claimed pod's archive (or capture natively: `cold-native…`
    runs), or a warm pod's (`warm-…` runs: before any claim)."""
    w.warm = run.startswith("warm-")
    w.fetching(identity, "", claimed_at=claimed_at)
    if run.startswith("cold-native"):
        w.fallback("bench: cold native start", identity=identity, engine_args=engine_args)
    else:
        w.ready(identity, archive_dir, engine_args=engine_args)


def wait(pred: Callable[[], Any], proc: subprocess.Popen[bytes], timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (got := pred()) is not None:
            return got
        if proc.poll() is not None:
            raise RuntimeError(f"ember serve exited {proc.returncode} before {what}")
        time.sleep(0.02)
    raise TimeoutError(f"no {what} within {timeout:.0f} s")


def engine_settled(run_dir: Path) -> dict[str, Any] | None:
    """The engine state once ready or failed, else None."""
    state = handoff.read_engine_state(run_dir) or {}
    return state if state.get("state") in (contract.ENGINE_READY, contract.ENGINE_FAILED) else None


def ready_report(w: handoff.HandoffWriter, seen: list[dict[str, Any]]) -> dict[str, Any] | None:
    seen.extend(w.new_reports())
    return next((r for r in seen if r.get("stage") == "ready"), None)


def drive(cmd: list[str], env: dict[str, str], log_path: Path,
          body: Callable[[subprocess.Popen[bytes]], None], res: dict[str, Any], index: str) -> None:
    """Start the engine process, run `body` on it (its figures into `res`; an error is the run's),
    then SIGTERM it as the kubelet does; its exit code, its log's tail on an error, the GPU after."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            body(proc)
        except (RuntimeError, TimeoutError, OSError, ValueError, KeyError) as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                res["exit_code"] = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                res["exit_code"] = proc.wait()
    if "error" in res:
        res["log_tail"] = log_path.read_text(errors="replace")[-6000:]
    res["gpu_after_exit_mib"] = gpu_used_mib(index)


def cold(w: handoff.HandoffWriter, proc: subprocess.Popen[bytes], port: int, claimed: float,
         res: dict[str, Any], timeout: float, index: str, describe: Describe | None = None) -> None:
    """A claimed pod: ready (its readiness passes), then the first request; the claim was the start."""
    seen: list[dict[str, Any]] = []
    res["ready_report"] = wait(lambda: ready_report(w, seen), proc, timeout, "the ready report")
    res["start_to_ready_s"] = round(time.time() - claimed, 3)
    model = served_model(port)
    done, res["first_token_refusals"] = first_token(port, model, timeout, proc)
    res["claim_to_first_token_s"] = round(done - claimed, 3)
    serving(port, model, res, index, proc.pid, describe)


def warm(w: handoff.HandoffWriter, proc: subprocess.Popen[bytes], port: int, started: float,
         res: dict[str, Any], timeout: float, idle_s: float, index: str,
         describe: Describe | None = None) -> None:
    """A warm pod: engine ready, idle, memory; the claim and at once the first request."""
    state = wait(lambda: engine_settled(w.run_dir), proc, timeout, "the engine's ready state")
    if state["state"] == contract.ENGINE_FAILED:
        raise RuntimeError(f"engine failed: {state.get('reason')}")
    res["start_to_ready_s"] = round(float(state["at"]) - started, 3)
    res["engine_state"] = state
    model = served_model(port)  # the client knows its model: not part of the claim's time
    time.sleep(idle_s)
    res["gpu_idle_mib"] = samples(index)
    res["gpu_idle_pod_mib"] = samples(index, pid=proc.pid)
    seen: list[dict[str, Any]] = []
    claimed = time.time()
    w.in_service(claimed)  # the sidecar's part of the claim
    done, res["first_token_refusals"] = first_token(port, model, timeout, proc)
    res["claim_to_first_token_s"] = round(done - claimed, 4)
    res["ready_report"] = wait(lambda: ready_report(w, seen), proc, 60.0, "the ready report")
    serving(port, model, res, index, proc.pid, describe)


def serving(port: int, model: str, res: dict[str, Any], index: str, pid: int,
            describe: Describe | None = None) -> None:
    if describe is not None:
        describe(port, res)
    res["tokens"], why = greedy(port, model)
    if why:
        res["tokens_error"] = why
    res["gpu_serving_mib"] = samples(index, n=3)
    res["gpu_serving_pod_mib"] = samples(index, n=3, pid=pid)
