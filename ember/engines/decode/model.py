"""Decode workloads with deterministic random weights (nothing downloaded), for SAVE, LOAD and bench.

Built-in shapes: Llama-3-8B, Qwen3-8B (q/k norm), a Qwen3-MoE shape (30B-A3B widths, fewer layers,
dense-dispatch experts so the graph is static), Gemma-3 (4B widths: sliding-window and global
layers, GeGLU, pre/post norms). Each eager or `-compile` (torch.compile, Triton kernels). A
decode step over a static KV cache is captured at the 67 engine-default sizes
[1, 2, 4] + 8..512 step 8. `--model-config FILE` / `--model DIR` take a transformers causal-LM
(see `HFDecodeWorkload`).

A step is self-contained so a restored graph can run a whole greedy decode loop by replay alone:
it reads `ids[:B]`, `pos[:B]`, writes K/V at `pos`, and writes the argmax token back into `ids`,
`pos += 1`, and the token into `history[step]`. SAVE and LOAD processes build the workload in the
same order with the same seed, so every allocation before the capture window repeats.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.engines.decode.parallel import SINGLE, Parallel
from ember.runtime import faults
from ember.runtime.proof.replay import fingerprint as fingerprint  # re-exported: the diagnostics use it

DEFAULT_SIZES: tuple[int, ...] = (1, 2, 4, *range(8, 513, 8))
DECODE_STEPS = 256
# EMBER_FAULT=view-offset puts back the fault this workload once had (ember.runtime.faults)
VIEW_OFFSET = faults.active("view-offset")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    qk_norm: bool = False
    experts: int = 0
    top_k: int = 0
    moe_inter: int = 0
    sliding_window: int = 0
    global_every: int = 0  # every Nth layer is global (Gemma-3: 6); 0 = all global
    act: str = "silu"
    sandwich_norms: bool = False
    embed_scale: bool = False
    rope_theta: float = 500000.0
    rope_local_theta: float = 10000.0


SPECS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec("llama3-8b", 4096, 32, 32, 8, 128, 14336, 128256),
    "qwen3-8b": ModelSpec("qwen3-8b", 4096, 36, 32, 8, 128, 12288, 151936, qk_norm=True, rope_theta=1e6),
    "qwen3-moe": ModelSpec(
        "qwen3-moe",
        2048,
        8,
        32,
        4,
        128,
        6144,
        151936,
        qk_norm=True,
        experts=128,
        top_k=8,
        moe_inter=768,
        rope_theta=1e6,
    ),
    "gemma3": ModelSpec(
        "gemma3",
        2560,
        34,
        8,
        4,
        256,
        10240,
        262144,
        qk_norm=True,
        sliding_window=128,
        global_every=6,
        act="gelu",
        sandwich_norms=True,
        embed_scale=True,
        rope_theta=1e6,
    ),
}


def spec_from_hf_config(cfg: dict[str, Any], name: str = "custom") -> ModelSpec:
    """A ModelSpec from a transformers causal-LM config.json (Llama, Qwen3, Qwen3-MoE, Gemma-3
    families and anything shaped like them); the decode graph is ember's own implementation of
    that shape with seeded random weights."""
    c = cfg.get("text_config", cfg)
    mt = str(c.get("model_type", ""))
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    gemma = mt.startswith("gemma")
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    layer_types = c.get("layer_types") or []
    every = 0
    if "full_attention" in layer_types and "sliding_attention" in layer_types:
        every = layer_types.index("full_attention") + 1
    elif c.get("sliding_window_pattern"):
        every = int(c["sliding_window_pattern"])
    return ModelSpec(
        name=name,
        hidden=hidden,
        layers=int(c["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        inter=int(c.get("intermediate_size") or 4 * hidden),
        vocab=int(c["vocab_size"]),
        qk_norm=mt.startswith(("qwen3", "gemma3")),
        experts=experts,
        top_k=int(c.get("num_experts_per_tok") or 0) if experts else 0,
        moe_inter=int(c.get("moe_intermediate_size") or 0) if experts else 0,
        sliding_window=int(c.get("sliding_window") or 0) if every else 0,
        global_every=every,
        act="gelu" if gemma else "silu",
        sandwich_norms=gemma,
        embed_scale=gemma,
        rope_theta=float(c.get("rope_theta") or 10000.0),
        rope_local_theta=float(c.get("rope_local_base_freq") or 10000.0),
    )


def workload_names() -> list[str]:
    return [n for s in SPECS for n in (s, f"{s}-compile")]


def parse_name(name: str) -> tuple[ModelSpec, bool]:
    base, compiled = (name[: -len("-compile")], True) if name.endswith("-compile") else (name, False)
    if base not in SPECS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(workload_names())}")
    return SPECS[base], compiled


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    f = pos.float()[:, None] * inv[None]
    c, s = f.cos()[:, None, :].to(x.dtype), f.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def _attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query decode attention as two batched GEMMs over the head-major cache.

    Deterministic on purpose: the kernel SDPA picked here (cuDNN flash) gave different bits for
    the same inputs once a sequence spans more than one 64-position block, so native decoding
    was not reproducible past step ~64 and no restored graph could be proven bitwise against it.
    q [b, H, D]; kc/vc [b, KVH, T, D] (b and KVH collapse to one batch dim without a copy);
    mask [b, T], True where a position may be attended.
    """
    b, heads, d = q.shape
    kvh, t = kc.shape[1], kc.shape[2]
    qg = q.reshape(b * kvh, heads // kvh, d)
    s = torch.bmm(qg, kc.reshape(b * kvh, t, d).transpose(1, 2)).float() * d**-0.5
    s = s.view(b, kvh, -1, t).masked_fill(~mask[:, None, None, :], float("-inf"))
    p = s.softmax(-1).to(q.dtype).view(b * kvh, -1, t)
    return torch.bmm(p, vc.reshape(b * kvh, t, d)).view(b, heads * d)


class Layer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, par: Parallel = SINGLE) -> None:
        super().__init__()
        s = spec
        self.spec, self.index, self.par = s, index, par
        self.local = bool(s.sliding_window) and not (s.global_every and (index + 1) % s.global_every == 0)
        # This rank's shard (ember.engines.decode.parallel): heads and MLP width by tensor rank,
        # experts by expert rank.
        self.heads, self.kv_heads = s.heads // par.tensor, s.kv_heads // par.tensor
        self.experts = s.experts // par.expert
        inter = s.inter // par.tensor
        self.qkv = nn.Linear(s.hidden, (self.heads + 2 * self.kv_heads) * s.head_dim, bias=False)
        self.o = nn.Linear(self.heads * s.head_dim, s.hidden, bias=False)
        self.n1 = nn.Parameter(torch.ones(s.hidden))
        self.n2 = nn.Parameter(torch.ones(s.hidden))
        if s.sandwich_norms:
            self.n1_post = nn.Parameter(torch.ones(s.hidden))
            self.n2_post = nn.Parameter(torch.ones(s.hidden))
        if s.qk_norm:
            self.qn = nn.Parameter(torch.ones(s.head_dim))
            self.kn = nn.Parameter(torch.ones(s.head_dim))
        if s.experts:
            self.router = nn.Linear(s.hidden, s.experts, bias=False)
            self.w_gu = nn.Parameter(torch.empty(self.experts, s.hidden, 2 * s.moe_inter))
            self.w_d = nn.Parameter(torch.empty(self.experts, s.moe_inter, s.hidden))
            if self.experts != s.experts:
                # Which experts are this rank's lives in device memory, written at build: a graph
                # reads it from one address on every rank, so one archive serves them all. A view
                # offset (`combine[:, first:]`) would freeze rank 0's offset into the kernel
                # arguments SAVE captured, and every other rank would weigh the wrong experts.
                ids = torch.empty(self.experts, dtype=torch.long)
                self.register_buffer("expert_ids", ids, persistent=False)
        else:
            self.gu = nn.Linear(s.hidden, 2 * inter, bias=False)
            self.d = nn.Linear(inter, s.hidden, bias=False)

    def place_experts(self) -> None:
        """Write this rank's expert ids (after the model is materialised on the device)."""
        if hasattr(self, "expert_ids"):
            first = (self.par.rank % self.par.expert) * self.experts
            self.expert_ids.copy_(torch.arange(first, first + self.experts))

    def _act(self, g: torch.Tensor) -> torch.Tensor:
        return F.gelu(g, approximate="tanh") if self.spec.act == "gelu" else F.silu(g)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if not s.experts:
            g, u = self.gu(h).chunk(2, -1)
            return self.par.all_reduce(self.d(self._act(g) * u))
        # Dense dispatch: every (local) expert sees every token, weighted by the top-k router mass.
        split = self.par.experts_split
        if split:
            h = self.par.gather_tokens(h)  # every rank's tokens reach this rank's experts
        probs = self.router(h).float().softmax(-1)
        w, idx = probs.topk(s.top_k, -1)
        w = (w / w.sum(-1, keepdim=True)).to(h.dtype)
        combine = torch.zeros(h.shape[0], s.experts, device=h.device, dtype=h.dtype).scatter(1, idx, w)
        if self.experts != s.experts and VIEW_OFFSET:  # the old EP fault, for its tests
            first = (self.par.rank % self.par.expert) * self.experts
            combine = combine[:, first : first + self.experts]
        elif self.experts != s.experts:
            combine = combine.index_select(1, self.expert_ids)
        gu = torch.matmul(h.unsqueeze(0), self.w_gu)  # [E, B, 2I]
        g, u = gu.chunk(2, -1)
        out = torch.matmul(self._act(g) * u, self.w_d)  # [E, B, H]
        out = (out * combine.t().unsqueeze(-1)).sum(0)
        return self.par.scatter_tokens(out) if split else out

    def forward(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        masks: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        s = self.spec
        b = x.shape[0]
        h = _rms(x, self.n1)
        nh, nkv = self.heads, self.kv_heads
        q, k, v = self.qkv(h).split([nh * s.head_dim, nkv * s.head_dim, nkv * s.head_dim], -1)
        q, k, v = q.view(b, nh, s.head_dim), k.view(b, nkv, s.head_dim), v.view(b, nkv, s.head_dim)
        if s.qk_norm:
            q, k = _rms(q, self.qn), _rms(k, self.kn)
        theta = s.rope_local_theta if self.local else s.rope_theta
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        rows = torch.arange(b, device=x.device)
        kc[rows, :, pos] = k
        vc[rows, :, pos] = v
        a = _attend(q, kc, vc, masks[1] if self.local else masks[0])
        a = self.par.all_reduce(self.o(a.reshape(b, -1)))
        if s.sandwich_norms:
            a = _rms(a, self.n1_post)
        x = x + a
        m = self.mlp(_rms(x, self.n2))
        if s.sandwich_norms:
            m = _rms(m, self.n2_post)
        return x + m


class DecodeModel(nn.Module):
    def __init__(self, spec: ModelSpec, par: Parallel = SINGLE) -> None:
        super().__init__()
        self.spec = spec
        self.emb = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(Layer(spec, i, par) for i in range(spec.layers))
        self.norm = nn.Parameter(torch.ones(spec.hidden))
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(
        self, ids: torch.Tensor, pos: torch.Tensor, kcache: torch.Tensor, vcache: torch.Tensor
    ) -> torch.Tensor:
        s = self.spec
        b = ids.shape[0]
        x = self.emb(ids)
        if s.embed_scale:
            x = x * math.sqrt(s.hidden)
        j = torch.arange(kcache.shape[3], device=ids.device)[None, :]
        causal = j <= pos[:, None]
        local = causal & (j > pos[:, None] - s.sliding_window) if s.sliding_window else causal
        masks = (causal, local)
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, kcache[i, :b], vcache[i, :b], masks)
        return self.head(_rms(x, self.norm))


@dataclass
class OutputSpec:
    """A graph output as LOAD sees it: a device address and its layout."""

    ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    def tensor(self) -> torch.Tensor:
        return tensor_at(self.ptr, self.shape, self.stride, self.dtype)


_CAI_TYPES = {
    "bfloat16": ("<i2", torch.bfloat16),
    "float16": ("<f2", None),
    "float32": ("<f4", None),
    "int64": ("<i8", None),
    "int32": ("<i4", None),
    "uint8": ("|u1", None),
    "bool": ("|b1", None),
}


def tensor_at(ptr: int, shape: tuple[int, ...], stride: tuple[int, ...], dtype: str) -> torch.Tensor:
    """A torch tensor over existing device memory (a graph output that LOAD never allocated)."""
    typestr, view_as = _CAI_TYPES[dtype]
    itemsize = getattr(torch, dtype).itemsize

    class _Mem:
        __cuda_array_interface__ = {  # noqa: RUF012
            "shape": tuple(shape),
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
            "strides": tuple(s * itemsize for s in stride),
        }

    t = torch.as_tensor(_Mem(), device="cuda")
    return t.view(view_as) if view_as is not None else t


class DecodeWorkload:
    """A decode step over a static KV cache, captured at many batch sizes."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        compiled: bool = False,
        sizes: tuple[int, ...] = DEFAULT_SIZES,
        seed: int = 1234,
        max_len: int = DECODE_STEPS + 8,
        name: str | None = None,
        deterministic: bool = False,
        weights: str | None = None,
        parallel: Parallel = SINGLE,
    ) -> None:
        parallel.validate(spec)
        if weights and parallel.world > 1:
            raise ValueError("a local checkpoint loads unsharded: parallel shapes use seeded weights")
        self.parallel = parallel  # this rank's shard of a tensor/expert/data-parallel world
        self.spec, self.compiled = spec, compiled
        self.weights = weights  # a local checkpoint directory (`--model DIR`), else seeded random
        self.deterministic = deterministic
        self.sizes = tuple(sorted(set(sizes)))
        self.max_batch = max(self.sizes)
        self.seed, self.max_len = seed, max_len
        self.name = name or (spec.name + ("-compile" if compiled else ""))
        self.dtype = torch.bfloat16
        self.model: DecodeModel | None = None
        self.outs: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}
        self.graphs: dict[tuple[int, ...], Any] = {}
        self._fn: Any = None

    @classmethod
    def from_name(cls, name: str, **kw: Any) -> DecodeWorkload:
        spec, compiled = parse_name(name)
        if kw.get("layers"):
            spec = replace(spec, layers=kw.pop("layers"))
        kw.pop("layers", None)
        return cls(spec, compiled=compiled, name=name, **kw)

    def config(self) -> dict[str, Any]:
        """What LOAD needs to build the same workload (stored in the manifest's engine facts)."""
        return {
            "workload": self.name,
            "spec": asdict(self.spec),
            "compiled": self.compiled,
            "sizes": list(self.sizes),
            "seed": self.seed,
            "max_len": self.max_len,
            "deterministic": self.deterministic,
            "weights": self.weights,
            "parallel": self.parallel.degrees(),
        }

    @classmethod
    def from_config(cls, cfg: dict[str, Any], rank: int = 0) -> DecodeWorkload:
        """The workload SAVE described, as rank `rank` of its parallel world."""
        return cls(
            ModelSpec(**cfg["spec"]),
            compiled=cfg["compiled"],
            sizes=tuple(cfg["sizes"]),
            seed=cfg["seed"],
            max_len=cfg["max_len"],
            name=cfg["workload"],
            deterministic=bool(cfg.get("deterministic", False)),
            weights=cfg.get("weights"),
            parallel=Parallel(**cfg.get("parallel", {}), rank=rank),
        )

    @property
    def kv_cache_bytes(self) -> int:
        s = self.spec
        kvh = s.kv_heads // self.parallel.tensor
        return 2 * s.layers * self.max_batch * self.max_len * kvh * s.head_dim * self.dtype.itemsize

    # ---- build (same order in SAVE and LOAD) ------------------------------------------------
    def build(self, kv_cache_bytes: int | None = None, compile_fn: bool = True) -> None:
        """Weights, KV cache and static buffers, always in this order. LOAD passes the archive's
        KV-cache size (no memory profiling) and `compile_fn=False` (it never runs the model)."""
        if kv_cache_bytes is not None and kv_cache_bytes != self.kv_cache_bytes:
            raise ValueError(
                f"archive's KV cache is {kv_cache_bytes} bytes, this workload's {self.kv_cache_bytes}"
            )
        s, dev = self.spec, torch.device("cuda")
        if self.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(self.seed)
        with torch.device("meta"):
            model = DecodeModel(s, self.parallel)
        model = model.to_empty(device=dev).to(self.dtype)
        gen = torch.Generator(device=dev)
        gen.manual_seed(self.seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("n1", "n2", "n1_post", "n2_post", "qn", "kn", "norm")):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
            for layer in model.layers:
                layer.place_experts()
        if self.weights:
            from ember.engines.decode.checkpoint import load_into

            load_into(model, self.weights, s)  # host → existing parameters: no device allocation
        self.model = model.eval()
        kvh = s.kv_heads // self.parallel.tensor  # this rank's KV heads
        shape = (s.layers, self.max_batch, kvh, self.max_len, s.head_dim)  # head-major
        self.kcache = torch.zeros(shape, device=dev, dtype=self.dtype)
        self.vcache = torch.zeros(shape, device=dev, dtype=self.dtype)
        self.ids = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.step_no = torch.zeros(1, dtype=torch.long, device=dev)
        self.history = torch.zeros(DECODE_STEPS + 1, self.max_batch, dtype=torch.long, device=dev)
        torch.cuda.synchronize()
        fn = self._step
        if self.compiled and compile_fn:
            # deterministic: reductions compiled by rule, not by timing at first launch, so SAVE's
            # kernels and a native process's sum in one order (ember.engines.vllm.args.NUMERICS)
            fn = torch.compile(fn, dynamic=True, fullgraph=False, options={"deterministic": True})
        self._fn = fn

    def input_addresses(self) -> dict[str, int]:
        """Addresses of the static buffers: LOAD checks them against SAVE's before any launch."""
        return {
            "ids": self.ids.data_ptr(),
            "pos": self.pos.data_ptr(),
            "step": self.step_no.data_ptr(),
            "history": self.history.data_ptr(),
            "kcache": self.kcache.data_ptr(),
            "vcache": self.vcache.data_ptr(),
        }

    def _step(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        step: torch.Tensor,
        hist: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.model is not None
        logits = self.model(ids, pos, kc, vc)
        tok = logits.argmax(-1)
        hist.index_copy_(0, step, tok[None])
        ids.copy_(tok)
        pos.add_(1).clamp_(max=self.max_len - 1)
        step.add_(1).clamp_(max=DECODE_STEPS)
        return logits, tok

    def step(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fn(
            self.ids[:b], self.pos[:b], self.step_no, self.history[:, :b], self.kcache, self.vcache
        )

    def reset_state(self, seed: int | None = None, one_step_of: int | None = None) -> None:
        """Everything a decode run reads, back to one state: ids (seeded), positions, step,
        history AND the KV cache. The causal mask already hides positions a run has not
        written, but only as long as what is there is finite; zeroing removes any dependence on
        what ran before (proof replays, TPOT loops, another process's history).
        `one_step_of=b`: since the last reset only one step of batch b ran (LOAD's canary between
        its paths), so only what it wrote goes back to zero: position 0 of the first b rows,
        not the whole cache (gigabytes for a full-size shape, ~10 ms a reset)."""
        if one_step_of is None:
            self.kcache.zero_()
            self.vcache.zero_()
        else:
            self.kcache[:, :one_step_of, :, 0].zero_()
            self.vcache[:, :one_step_of, :, 0].zero_()
        gen = torch.Generator(device="cuda")
        gen.manual_seed(self.seed if seed is None else seed)
        self.ids.copy_(torch.randint(0, self.spec.vocab, (self.max_batch,), device="cuda", generator=gen))
        self.pos.zero_()
        self.step_no.zero_()
        self.history.zero_()

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.ids, self.pos, self.step_no]

    # ---- capture ----------------------------------------------------------------------------
    def capture(
        self, sizes: tuple[int, ...] | None = None, capture_error_mode: str = "global"
    ) -> dict[tuple[int, ...], Any]:
        """Warm up and capture every size, largest first, into one shared pool (engine style).
        `capture_error_mode="thread_local"` captures in a LOAD process (the bench's control): there
        the global mode's capture was invalidated (H100; libember's background threads or its
        mapping of the pool's memory, not isolated)."""
        pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            for b in sorted(sizes or self.sizes, reverse=True):
                self.step(b)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph(keep_graph=True)
                with torch.cuda.graph(g, pool=pool, capture_error_mode=capture_error_mode):
                    out = self.step(b)
                self.outs[(b,)] = out
                self.graphs[(b,)] = g
        torch.cuda.synchronize()
        return self.graphs

    def output_specs(self) -> dict[tuple[int, ...], list[OutputSpec]]:
        return {
            k: [
                OutputSpec(t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype).split(".")[-1])
                for t in v
            ]
            for k, v in self.outs.items()
        }
