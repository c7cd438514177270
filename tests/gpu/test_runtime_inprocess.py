"""GPU: walk → encode → decode → rebuild → replay in ONE process, bitwise against the captured graphs.

Needs no native library (kernels are found by their live module handle). Small layer counts keep
it quick; the full shapes run in `ember bench graphs`.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
cu = pytest.importorskip("cuda.bindings.driver")


def _prove(name: str, layers: int, sizes: tuple[int, ...]) -> None:
    from ember.engines.decode.model import DecodeWorkload
    from ember.runtime.graphs.kernels import LiveResolver
    from ember.runtime.graphs.walk import GraphWalker
    from ember.runtime.proof.prove import prove

    w = DecodeWorkload.from_name(name, layers=layers, sizes=sizes)
    w.build()
    w.capture()
    resolver = LiveResolver()
    walker = GraphWalker(resolver)
    graphs = [walker.walk(w.graphs[(b,)].raw_cuda_graph(), (b,)) for b in w.sizes]
    gs = walker.graph_set(graphs)
    rep, blob, lib = prove(w, gs, lambda refs: [resolver.function(r) for r in refs])
    assert rep.ok, rep.mismatches
    assert rep.template_ok == len(sizes)
    assert len(blob) > 0 and rep.templates <= len(sizes)
    # A restored library can decode greedily by replay alone, identically to the native graphs.
    from ember.runtime.proof.replay import decode_tokens

    native, _ = decode_tokens(w, lambda k: w.graphs[k].replay(), sizes[-1], steps=16)
    restored, _ = decode_tokens(w, lambda k: lib.launch(lib.key_index(k)), sizes[-1], steps=16)
    assert native == restored
    lib.close()


@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-moe", "gemma3"])
def test_eager_workloads_rebuild_bit_identical(name: str) -> None:
    _prove(name, layers=2, sizes=(1, 2, 8, 16, 24))


def test_compiled_workload_rebuild_bit_identical() -> None:
    _prove("qwen3-8b-compile", layers=2, sizes=(1, 4, 8, 16))


def test_decode_attention_matches_sdpa() -> None:
    import torch.nn.functional as F

    from ember.engines.decode.model import _attend

    g = torch.Generator(device="cuda").manual_seed(0)
    b, heads, kvh, t, d = 5, 32, 8, 200, 128
    q = torch.randn(b, heads, d, device="cuda", generator=g, dtype=torch.bfloat16)
    kc = torch.randn(b, kvh, t, d, device="cuda", generator=g, dtype=torch.bfloat16)
    vc = torch.randn(b, kvh, t, d, device="cuda", generator=g, dtype=torch.bfloat16)
    pos = torch.tensor([0, 3, 63, 64, 199], device="cuda")
    mask = torch.arange(t, device="cuda")[None, :] <= pos[:, None]
    ours = _attend(q, kc, vc, mask).float()
    ref = F.scaled_dot_product_attention(
        q[:, :, None].float(), kc.float(), vc.float(), attn_mask=mask[:, None, None, :], enable_gqa=True
    ).reshape(b, -1)
    assert (ours - ref).abs().max().item() < 2e-2
    assert torch.equal(_attend(q, kc, vc, mask), _attend(q, kc, vc, mask))


def test_native_decoding_is_reproducible_past_one_attention_block() -> None:
    """Two 160-step greedy decodes by replay from one state give the same tokens (the SDPA kernel
    used before did not, from about step 64 on, so nothing could be proven against it)."""
    from ember.engines.decode.model import DecodeWorkload
    from ember.runtime.proof.replay import decode_tokens

    w = DecodeWorkload.from_name("llama3-8b", layers=4, sizes=(1, 8))
    w.build()
    w.capture()
    runs = [decode_tokens(w, lambda k: w.graphs[k].replay(), 8, steps=160)[0] for _ in range(2)]
    assert runs[0] == runs[1]


def test_local_checkpoint_weights_land_and_graphs_rebuild(tmp_path: Path) -> None:
    """`--model DIR`: a small Llama-shaped checkpoint (random, written here) fills the fused
    projections, and its decode graphs rebuild bit-identically."""
    import json

    from safetensors.torch import save_file

    from ember.engines.decode.workloads import make_workload

    h, inter, heads, kv, vocab, layers = 256, 512, 4, 2, 1000, 2
    cfg = {"model_type": "llama", "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
           "num_key_value_heads": kv, "num_hidden_layers": layers, "vocab_size": vocab, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    d = h // heads

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": r(vocab, h), "model.norm.weight": r(h), "lm_head.weight": r(vocab, h)}
    for i in range(layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        t |= {f"{a}q_proj.weight": r(heads * d, h), f"{a}k_proj.weight": r(kv * d, h),
              f"{a}v_proj.weight": r(kv * d, h), f"{a}o_proj.weight": r(h, heads * d),
              f"{m}gate_proj.weight": r(inter, h), f"{m}up_proj.weight": r(inter, h),
              f"{m}down_proj.weight": r(h, inter),
              f"model.layers.{i}.input_layernorm.weight": r(h),
              f"model.layers.{i}.post_attention_layernorm.weight": r(h)}
    save_file(t, str(tmp_path / "model.safetensors"))
    w = make_workload("checkpoint", 0, (1, 8), model_dir=str(tmp_path))
    w.build()
    params = dict(w.model.named_parameters())
    a = "model.layers.1.self_attn."
    want = torch.cat([t[f"{a}q_proj.weight"], t[f"{a}k_proj.weight"], t[f"{a}v_proj.weight"]])
    assert torch.equal(params["layers.1.qkv.weight"].cpu(), want)
    assert torch.equal(params["head.weight"].cpu(), t["lm_head.weight"])
    assert w.config()["weights"] == str(tmp_path.absolute())

    from ember.runtime.graphs.kernels import LiveResolver
    from ember.runtime.graphs.walk import GraphWalker
    from ember.runtime.proof.prove import prove

    w.capture()
    resolver = LiveResolver()
    walker = GraphWalker(resolver)
    gs = walker.graph_set([walker.walk(w.graphs[(b,)].raw_cuda_graph(), (b,)) for b in w.sizes])
    rep, _, lib = prove(w, gs, lambda refs: [resolver.function(x) for x in refs])
    assert rep.ok, rep.mismatches
    lib.close()


def test_host_node_is_refused_with_graph_and_node() -> None:
    from ember.runtime.graphs.kernels import LiveResolver
    from ember.runtime.graphs.walk import GraphWalker, WalkRefused

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    _, g = cu.cuGraphCreate(0)
    cb = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _p: None)
    hp = cu.CUDA_HOST_NODE_PARAMS()
    hp.fn = ctypes.cast(cb, ctypes.c_void_p).value
    cu.cuGraphAddEmptyNode(g, None, 0)
    err, _ = cu.cuGraphAddHostNode(g, None, 0, hp)
    assert err == cu.CUresult.CUDA_SUCCESS
    with pytest.raises(WalkRefused, match=r"graph \(42,\): node 1: host node"):
        GraphWalker(LiveResolver()).walk(g, (42,))
    cu.cuGraphDestroy(g)


PDL_SRC = r"""
extern "C" __global__ void producer(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = 1.5f * i;
  asm volatile("griddepcontrol.launch_dependents;");
}
extern "C" __global__ void consumer(const float* x, float* y, int n) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] + 2.0f;
}
"""


def test_programmatic_edge_data_restored(tmp_path: Path) -> None:
    """Two kernels joined by a programmatic (PDL) edge: the edge data survives SAVE → LOAD."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    from ember.archive import graph_table
    from ember.runtime.graphs import rebuild
    from ember.runtime.graphs.driver import check, graph_edges, graph_nodes
    from ember.runtime.graphs.kernels import LiveResolver
    from ember.runtime.graphs.walk import GraphWalker

    src = tmp_path / "pdl.cu"
    src.write_text(PDL_SRC)
    cubin = tmp_path / "pdl.cubin"
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-o", str(cubin), str(src)], check=True)
    torch.zeros(1, device="cuda")
    data = cubin.read_bytes()
    mod = check(cu.cuModuleLoadData(data), "cuModuleLoadData")
    prod = check(cu.cuModuleGetFunction(mod, b"producer"), "producer")
    cons = check(cu.cuModuleGetFunction(mod, b"consumer"), "consumer")
    n = 4096
    x = torch.zeros(n, device="cuda")
    y = torch.zeros(n, device="cuda")

    def kparams(func: object, args: list[tuple[object, object]]) -> object:
        p = cu.CUDA_KERNEL_NODE_PARAMS()
        p.func = func
        p.gridDimX, p.gridDimY, p.gridDimZ = n // 256, 1, 1
        p.blockDimX, p.blockDimY, p.blockDimZ = 256, 1, 1
        p.kernelParams = (tuple(a for a, _ in args), tuple(t for _, t in args))
        return p

    g = check(cu.cuGraphCreate(0), "cuGraphCreate")
    a = check(
        cu.cuGraphAddKernelNode(
            g, None, 0, kparams(prod, [(x.data_ptr(), ctypes.c_void_p), (n, ctypes.c_int)])
        ),
        "add",
    )
    b = check(
        cu.cuGraphAddKernelNode(
            g,
            None,
            0,
            kparams(
                cons, [(x.data_ptr(), ctypes.c_void_p), (y.data_ptr(), ctypes.c_void_p), (n, ctypes.c_int)]
            ),
        ),
        "add",
    )
    edge = cu.CUgraphEdgeData()
    edge.type = cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    edge.from_port = cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    check(cu.cuGraphAddDependencies(g, [a], [b], [edge], 1), "cuGraphAddDependencies")
    # A default edge listed BEFORE the programmatic one (what a captured decode graph looks like):
    # the rebuild once added such mixed edge lists with the programmatic data lost.
    head = check(cu.cuGraphAddEmptyNode(g, None, 0), "cuGraphAddEmptyNode")
    check(cu.cuGraphAddDependencies(g, [head], [a], None, 1), "cuGraphAddDependencies")

    resolver = LiveResolver()
    walker = GraphWalker(resolver)
    walked = walker.walk(g, (1,))
    assert sorted((e.type, e.from_port) for e in walked.edges) == [
        (0, 0),
        (1, int(cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC)),
    ]
    gs = walker.graph_set([walked])
    table = graph_table.decode(graph_table.encode(gs))
    decoded = table.graph(0)
    assert decoded.edges == walked.edges
    functions = [resolver.function(r) for r in table.kernels]
    prep = rebuild.prepare(decoded, functions, None)
    assert prep.edge_data is not None and prep.edge_src[0] != prep.edge_src[1]
    g2 = rebuild.build(prep, None, [])  # edges through driver.add_dependencies, read back inside
    frm, to, data = graph_edges(g2)  # our own buffers: the binding's edge data points at freed memory
    port = int(cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC)
    nodes = [int(n) for n in graph_nodes(g2)]
    types = [n.type for n in walked.nodes]  # rebuilt nodes are created in the walked order
    got = sorted(
        (types[nodes.index(f)].name, types[nodes.index(t)].name, data[8 * j], data[8 * j + 2])
        for j, (f, t) in enumerate(zip(frm, to, strict=True))
    )
    assert got == [("EMPTY", "KERNEL", 0, 0), ("KERNEL", "KERNEL", port, 1)], got
    ex = rebuild.instantiate(g2)
    check(cu.cuGraphLaunch(ex, cu.CUstream(torch.cuda.current_stream().cuda_stream)), "launch")
    torch.cuda.synchronize()
    want = torch.arange(n, device="cuda", dtype=torch.float32) * 1.5 + 2.0
    assert torch.equal(y, want)
    for h in (ex,):
        cu.cuGraphExecDestroy(h)
    cu.cuGraphDestroy(g)
    cu.cuGraphDestroy(g2)


class _RandomWorkload:
    """What the decode SAVE touches before its walk: build(), capture(), sizes, graphs. Graph (1,)
    draws random numbers, graph (2,) does not."""

    sizes = (1, 2)

    def __init__(self) -> None:
        from ember.engines.decode.parallel import SINGLE

        self.parallel = SINGLE  # one GPU
        self.graphs: dict[tuple[int, ...], object] = {}

    def build(self) -> None:
        self.x = torch.zeros(4, 64, device="cuda")

    def capture(self) -> dict[tuple[int, ...], object]:
        steps = {(1,): lambda: self.x.add_(torch.rand_like(self.x)), (2,): lambda: self.x.mul_(2)}
        for key, step in steps.items():
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph):
                step()
            self.graphs[key] = graph
        return self.graphs


def test_graphs_that_draw_random_numbers_are_found_and_not_published() -> None:
    from ember.engines.decode.adapter import save_workload
    from ember.runtime.proof.prove import ProofFailed, rng_consumers

    w = _RandomWorkload()
    w.build()
    w.capture()
    found = rng_consumers(w.graphs)
    assert list(found) == [(1,)] and found[(1,)] > 0
    with pytest.raises(ProofFailed, match=r"1 graphs draw random numbers \(e.g. graph \(1,\)"):
        save_workload(_RandomWorkload(), store_uri=None, allow_in_process=True, log=lambda m: None)  # type: ignore[arg-type]
