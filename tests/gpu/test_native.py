"""libember on a real GPU (run on a GPU machine: `pytest -m gpu tests/gpu/test_native.py`).

Each check runs workers in fresh processes (this file is also the worker: `python test_native.py
ROLE OUT.json`), with LD_PRELOAD=libember.so where the check needs it:
(a) pass-through is bit-identical (cuBLAS, cuDNN attention, a Triton kernel, torch.compile);
(b) two SAVE runs, the second perturbed before arming, hand out the same region addresses in the
    same order, with the default allocator and with expandable segments;
(c) every kernel node of captured graphs of a Llama-3-8B-shaped model (2 layers, random
    weights) maps to a catalog entry;
(d) an injected extra allocation in a LOAD run is reported as divergence and the process keeps
    running (and without the injection the window replays at SAVE's addresses).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
ALLOCATORS = {"default": "", "expandable": "expandable_segments:True"}


# ---------------------------------------------------------------- test side

def _lib() -> str:
    from ember import native

    path = os.environ.get("EMBER_LIB") or native.find_library()
    if not path:
        pytest.skip("libember.so not built")
    return str(path)


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Shared compile caches: only the first worker pays for Triton/Inductor compiles."""
    d = tmp_path_factory.mktemp("compile-cache")
    return {"TRITON_CACHE_DIR": str(d / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor")}


class Worker:
    """One worker process (started at once; `result()` waits for it)."""

    def __init__(self, role: str, tmp: Path, *, ember: str | None, alloc: str = "default",
                 env: dict[str, str] | None = None, caches: dict[str, str] | None = None) -> None:
        self.name = f"{role}-{ember}-{alloc}-{len(list(tmp.iterdir()))}"
        self.out = tmp / f"{self.name}.json"
        e = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_") and k != "LD_PRELOAD"}
        e.update(caches or {})
        e["PYTHONPATH"] = f"{ROOT}:{e.get('PYTHONPATH', '')}"
        e["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATORS[alloc]
        e["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        if ember is not None:
            e["LD_PRELOAD"] = _lib()
            e["EMBER_LIB"] = _lib()
            e["EMBER_MODE"] = ember
            e["EMBER_LOG"] = "info"
        e.update(env or {})
        self.log = (tmp / f"{self.name}.log").open("w")
        self.proc = subprocess.Popen([sys.executable, str(HERE), role, str(self.out)], env=e, stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True)

    def result(self, timeout: float = 200) -> dict[str, Any]:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        text = Path(self.log.name).read_text()
        if rc != 0 or not self.out.exists():
            return {"error": f"worker {self.name} failed rc={rc}:\n{text[-6000:]}"}
        return json.loads(self.out.read_text())


def run_all(*workers: Worker) -> list[dict[str, Any]]:
    """Waits for workers that run concurrently (one GPU; each process has its own address space)."""
    return [w.result() for w in workers]


def ok(*results: dict[str, Any]) -> None:
    for r in results:
        assert "error" not in r, r["error"]


def _region_events(log: str) -> list[tuple[str, str, str, str]]:
    """(kind, addr, size, align) of every event after arming."""
    rows = [line.split() for line in log.splitlines() if line.startswith("E ")]
    return [(r[2], r[4], r[5], r[6]) for r in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, caches: dict[str, str]) -> dict[str, Any]:
    """All workers, in three phases of concurrent processes: cold compiles first (no ember), so
    that the SAVE runs compared with each other all find warm compile caches."""
    tmp = tmp_path_factory.mktemp("native-gpu")
    log = tmp / "alloc.log"
    res: dict[str, Any] = {}
    w = {f"base-{a}": Worker("workload", tmp, ember=None, alloc=a, caches=caches) for a in ALLOCATORS}
    res.update(zip(w, run_all(*w.values()), strict=True))
    manual = {"EMBER_ARM": "manual"}
    w = {}
    for a in ALLOCATORS:
        w[f"off-{a}"] = Worker("workload", tmp, ember="off", alloc=a, caches=caches)
        w[f"save-{a}"] = Worker("workload", tmp, ember="save", alloc=a, caches=caches, env=manual)
        w[f"perturbed-{a}"] = Worker("workload", tmp, ember="save", alloc=a, caches=caches,
                                     env={**manual, "PERTURB": "1"})
    w["graphs"] = Worker("graphs", tmp, ember="save", caches=caches)
    w["save-window"] = Worker("save-window", tmp, ember="save", caches=caches, env={"LOGFILE": str(log)})
    res.update(zip(w, run_all(*w.values()), strict=True))
    w = {"load-window": Worker("load-window", tmp, ember="load", caches=caches, env={"LOGFILE": str(log)}),
         "load-inject": Worker("load-window", tmp, ember="load", caches=caches,
                               env={"LOGFILE": str(log), "INJECT": "1"})}
    res.update(zip(w, run_all(*w.values()), strict=True))
    if report := os.environ.get("EMBER_TEST_REPORT"):  # a summary for the bench notes
        brief = {k: {kk: vv for kk, vv in v.items() if kk not in ("log",)} for k, v in res.items()}
        Path(report).write_text(json.dumps(brief, indent=1, default=str))
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("alloc", list(ALLOCATORS))
def test_pass_through_is_bit_identical(alloc: str, runs: dict[str, Any]) -> None:
    base, off = runs[f"base-{alloc}"], runs[f"off-{alloc}"]
    ok(base, off, runs[f"save-{alloc}"])
    assert set(base["hashes"]) == {"cublas", "cudnn_sdpa", "triton", "compiled"}
    assert base["sdpa_backend_ok"], "cuDNN attention did not run"
    assert off["hashes"] == base["hashes"], "(a) pass-through changed results"
    assert runs[f"save-{alloc}"]["hashes"] == base["hashes"], "SAVE mode changed results"


@pytest.mark.gpu
@pytest.mark.parametrize("alloc", list(ALLOCATORS))
def test_perturbed_save_runs_get_the_same_region_addresses(alloc: str, runs: dict[str, Any]) -> None:
    clean, perturbed = runs[f"save-{alloc}"], runs[f"perturbed-{alloc}"]
    ok(clean, perturbed)
    assert perturbed["perturbed_native"] >= 4, "the perturbation did not allocate outside the region"
    a, b = _region_events(clean["log"]), _region_events(perturbed["log"])
    assert len(a) >= 3, clean["log"]
    assert a == b, "(b) the perturbed SAVE run got other region addresses"
    region_base = clean["region"][0]
    assert region_base and all(int(e[1], 16) >= region_base for e in a if e[0] in ("alloc", "reserve"))
    if alloc == "expandable":
        assert any(e[0] == "reserve" for e in a), "expandable segments' reservation missed the region"


@pytest.mark.gpu
def test_every_graph_kernel_node_is_in_the_catalog(runs: dict[str, Any]) -> None:
    r = runs["graphs"]
    ok(r)
    assert r["kernel_nodes"] > 50
    assert r["missing"] == [], f"(c) {len(r['missing'])} kernel nodes not in the catalog: {r['missing'][:10]}"
    assert r["triton_nodes"] > 0, "no torch.compile/Triton kernel node (kern == 0) was checked"
    assert r["images"] > 0 and r["with_bytes"] == r["images"]


@pytest.mark.gpu
def test_load_replays_window_and_reports_injected_divergence(runs: dict[str, Any]) -> None:
    saved, good, bad = runs["save-window"], runs["load-window"], runs["load-inject"]
    ok(saved, good, bad)
    assert good["divergence"] is None and good["replayed"], good
    assert good["window_addrs"] == saved["window_addrs"] and saved["window_addrs"]
    assert bad["divergence"] and "differs from SAVE" in bad["divergence"], bad
    assert bad["raised"] == "EmberDivergence" and bad["after_ok"], "(d) the process did not keep running"


# ---------------------------------------------------------------- worker side

def _digest(t: Any) -> str:
    import torch

    raw = t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _interposer() -> Any:
    if not os.environ.get("EMBER_MODE"):
        return None
    from ember.native import Interposer

    return Interposer.attach()


def _perturb(alloc_conf: str) -> int:
    """Allocations and work before arming: raw driver allocations (they stay) and, with the
    default allocator, PyTorch tensors and kernels (freed, cache emptied)."""
    import torch

    cu = _driver()
    p, n = ctypes.c_uint64(), 0
    for size in (3 << 20, 12345, 64 << 20):
        n += cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(size)) == 0
    r = ctypes.c_uint64()
    n += cu.cuMemAddressReserve(ctypes.byref(r), ctypes.c_size_t(8 << 30), ctypes.c_size_t(0),
                                ctypes.c_uint64(0), ctypes.c_ulonglong(0)) == 0
    if "expandable" not in alloc_conf:
        xs = [torch.randn(k, device="cuda") for k in (1000, 1 << 20, 5 << 20)]
        (xs[0] * 2 + 1).sum().item()
        del xs
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return n


def _workload() -> tuple[dict[str, str], bool]:
    import torch
    import torch.nn.functional as F
    import triton
    import triton.language as tl
    from torch.nn.attention import SDPBackend, sdpa_kernel

    @triton.jit
    def axpy(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=m) * 2.0 + tl.load(y_ptr + i, mask=m), mask=m)

    torch.manual_seed(0)
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    mm = a @ b
    q, k, v = (torch.randn(4, 32, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ok = True
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except RuntimeError:
        ok = False
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = torch.randn(1 << 20, device="cuda")
    y = torch.randn(1 << 20, device="cuda")
    out = torch.empty_like(x)
    axpy[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), BLOCK=1024)
    fn = torch.compile(lambda t: F.gelu(t) * 2 + torch.sin(t))
    comp = fn(mm.float())
    torch.cuda.synchronize()
    return {"cublas": _digest(mm), "cudnn_sdpa": _digest(att), "triton": _digest(out),
            "compiled": _digest(comp)}, ok


def worker_workload(res: dict[str, Any]) -> None:
    import torch

    torch.cuda.synchronize()  # the primary context, before any PyTorch allocation
    if os.environ.get("PERTURB") == "1":
        res["perturbed_native"] = _perturb(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    ip = _interposer()
    if ip is not None and ip.mode != "off":
        ip.arm()
    res["hashes"], res["sdpa_backend_ok"] = _workload()
    if ip is not None and ip.mode != "off":
        res["log"] = ip.export_alloc_log().decode()
        res["region"] = list(ip.region())
        res["stats"] = ip.stats()


def _llama(layers: int, compiled: bool = True) -> tuple[Any, Any, Any, Any, Any]:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    H, NH, KV, INTER, VOCAB, L, MAXBS = 4096, 32, 8, 14336, 128256, 256, 16
    hd = H // NH
    def act(g: Any, u: Any) -> Any:
        return F.silu(g) * u

    if compiled:  # Triton kernels in the graphs (kern == 0 nodes)
        act = torch.compile(act, dynamic=False)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(H, (NH + 2 * KV) * hd, bias=False)
            self.o = nn.Linear(NH * hd, H, bias=False)
            self.gu = nn.Linear(H, 2 * INTER, bias=False)
            self.d = nn.Linear(INTER, H, bias=False)
            self.n1, self.n2 = nn.RMSNorm(H), nn.RMSNorm(H)

    def rope(x: Any, pos: Any) -> Any:
        d = x.shape[-1]
        inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
        f = pos.float()[:, None] * inv[None]
        c, s = f.cos()[:, None, :].to(x.dtype), f.sin()[:, None, :].to(x.dtype)
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, H)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm = nn.RMSNorm(H)
            self.head = nn.Linear(H, VOCAB, bias=False)

        def forward(self, ids: Any, pos: Any, kcache: Any, vcache: Any) -> Any:
            B = ids.shape[0]
            x = self.emb(ids)
            mask = (torch.arange(L, device=ids.device)[None, :] <= pos[:, None])[:, None, None, :]
            for i, lyr in enumerate(self.layers):
                q, k, v = lyr.qkv(lyr.n1(x)).split([NH * hd, KV * hd, KV * hd], -1)
                q, k = rope(q.view(B, NH, hd), pos), rope(k.view(B, KV, hd), pos)
                kc, vc = kcache[i, :B], vcache[i, :B]
                rows = torch.arange(B, device=ids.device)
                kc.index_put_((rows, pos), k.view(B, KV, hd))
                vc.index_put_((rows, pos), v.view(B, KV, hd))
                a = F.scaled_dot_product_attention(q[:, :, None], kc.transpose(1, 2), vc.transpose(1, 2),
                                                   attn_mask=mask, enable_gqa=True)
                x = x + lyr.o(a.reshape(B, -1))
                g, u = lyr.gu(lyr.n2(x)).chunk(2, -1)
                x = x + lyr.d(act(g, u))
            return self.head(self.norm(x)).argmax(-1)

    torch.manual_seed(0)
    with torch.device("meta"):
        m = Model()
    m = m.to_empty(device="cuda").to(torch.bfloat16)
    for p in m.parameters():
        nn.init.normal_(p, std=0.02)
    kc = torch.zeros(layers, MAXBS, L, KV, hd, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    ids = torch.zeros(MAXBS, dtype=torch.long, device="cuda")
    pos = torch.full((MAXBS,), 7, dtype=torch.long, device="cuda")
    return m, kc, vc, ids, pos


def _capture(m: Any, kc: Any, vc: Any, ids: Any, pos: Any, sizes: list[int], ip: Any,
             capture: bool = True) -> dict[int, Any]:
    """Warm-up, then (SAVE) capture the graphs inside the window; capture=False stops after warm-up."""
    import torch

    graphs, outs = {}, {}
    pool = torch.cuda.graph_pool_handle()
    with torch.inference_mode():
        for B in sizes:  # warm-up (lazy loads, compiles) before the window
            m(ids[:B], pos[:B], kc, vc)
        torch.cuda.synchronize()
        if not capture:
            return graphs
        if ip is not None:
            ip.capture_begin()
        for B in sizes:
            g = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(g, pool=pool):
                outs[B] = m(ids[:B], pos[:B], kc, vc)
            graphs[B] = g
        torch.cuda.synchronize()
        if ip is not None:
            ip.capture_end()
    return graphs


class KernelNodeParams(ctypes.Structure):
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("smem", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def _kernel_nodes(graph: int) -> list[tuple[int, int]]:
    cu = _driver()
    n = ctypes.c_size_t(0)
    assert cu.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n)) == 0
    nodes = (ctypes.c_void_p * n.value)()
    assert cu.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(n)) == 0
    out = []
    for nd in nodes:
        t = ctypes.c_int()
        assert cu.cuGraphNodeGetType(ctypes.c_void_p(nd), ctypes.byref(t)) == 0
        if t.value != 0:  # CU_GRAPH_NODE_TYPE_KERNEL
            continue
        p = KernelNodeParams()
        assert cu.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(nd), ctypes.byref(p)) == 0
        out.append((p.func or 0, p.kern or 0))
    return out


def worker_graphs(res: dict[str, Any]) -> None:
    ip = _interposer()
    m, kc, vc, ids, pos = _llama(int(os.environ.get("LAYERS", "2")))
    graphs = _capture(m, kc, vc, ids, pos, [8, 1], ip)
    cu = _driver()
    cu.cuFuncGetName.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p]
    missing, total, triton_nodes = [], 0, 0
    for g in graphs.values():
        for func, kern in _kernel_nodes(g.raw_cuda_graph()):
            total += 1
            triton_nodes += kern == 0
            hit = ip.lookup(func, kern)
            if hit is None:
                name = ctypes.c_char_p()
                cu.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(func))
                missing.append((name.value or b"?").decode())
    cat = ip.catalog()
    res.update(kernel_nodes=total, triton_nodes=triton_nodes, missing=missing, images=len(cat),
               with_bytes=sum(c["have_bytes"] for c in cat), kinds=sorted({c["kind"] for c in cat}),
               stats=ip.stats())


def _window_run(res: dict[str, Any], load: bool) -> None:
    import torch

    ip = _interposer()
    torch.cuda.synchronize()
    ip.arm()
    if load:
        ip.import_alloc_log(Path(os.environ["LOGFILE"]).read_bytes())
    m, kc, vc, ids, pos = _llama(1, compiled=False)
    if os.environ.get("INJECT") == "1":  # an allocation SAVE did not make, straight to the driver
        p = ctypes.c_uint64()
        assert _driver().cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(8 << 20)) == 0
        res["extra"] = p.value
    _capture(m, kc, vc, ids, pos, [1], ip, capture=not load)
    if load:
        from ember.runtime.restore import release_cached_memory

        # As LOAD does: SAVE's capture emptied torch's cache inside the window, so the blocks the
        # replay frees at SAVE's places must not still be held by torch's cache here.
        release_cached_memory(ip)
        try:
            ip.replay_window()
            res["replayed"], res["raised"] = True, None
        except Exception as exc:  # EmberDivergence expected when injected
            res["replayed"], res["raised"] = False, type(exc).__name__
        res["divergence"] = ip.divergence()
        with torch.inference_mode():  # the process keeps working after a divergence
            out = m(ids[:1], pos[:1], kc, vc)
            torch.cuda.synchronize()
            res["after_ok"] = bool(out.numel() == 1)
    else:
        Path(os.environ["LOGFILE"]).write_bytes(ip.export_alloc_log())
    log = ip.export_alloc_log().decode()
    res["window_addrs"] = [line.split()[4] for line in log.splitlines() if " window " in line]
    res["stats"] = ip.stats()


def main(role: str, out: str) -> None:
    import faulthandler
    import time

    faulthandler.dump_traceback_later(170, exit=True)  # a hang shows its stack in the worker's log
    t0 = time.perf_counter()
    res: dict[str, Any] = {"role": role}
    if role == "workload":
        worker_workload(res)
    elif role == "graphs":
        worker_graphs(res)
    elif role in ("save-window", "load-window"):
        _window_run(res, load=role == "load-window")
    else:
        raise SystemExit(f"unknown role {role}")
    res["wall_s"] = time.perf_counter() - t0
    Path(out).write_text(json.dumps(res, default=str))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
