"""One vLLM engine start for `ember bench vllm` (a fresh process; argv[1] is its JSON arguments).

Times the engine's construction and the first token, counts graphs captured while serving, and
keeps the greedy tokens of several batch sizes for comparison across runs."""

from __future__ import annotations

import time

T0 = time.perf_counter()  # before any import: start → first token counts the imports too

import itertools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402


def prompts(batch: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(rng.randrange(5, 60))]}
        for _ in range(batch)
    ]


async def generate_together(llm: Any, batch: list[dict[str, list[int]]], params: Any, prefix: str,
                            dp_rank: int | None = None) -> list[list[int]]:
    """vLLM's async engine (`AsyncLLM`): the tokens of every prompt of `batch`, all of them
    scheduled from the same engine step. vLLM is not batch-invariant, and requests sent one after
    another join whichever step is running when each arrives: the steps' shapes, and so a greedy
    near-tie, would follow the timing, and two runs of one engine could differ without a fault.
    The requests are added while the scheduler is paused (vLLM queues them) and run from its resume;
    `dp_rank` sends them all to one data-parallel rank."""
    await llm.pause_generation(mode="keep", clear_cache=False)
    try:
        queues = [await llm.add_request(f"{prefix}-{i}", p, params, data_parallel_rank=dp_rank)
                  for i, p in enumerate(batch)]
    finally:
        await llm.resume_generation()
    tokens = []
    for q in queues:
        out = await q.get()
        while not out.finished:
            out = await q.get()
        tokens.append(list(out.outputs[0].token_ids))
    return tokens


async def greedy_tokens(llm: Any, batch_sizes: list[int], vocab: int, params: Any,
                        data_parallel: int = 1) -> dict[str, list[list[int]]]:
    """The tokens of a batch of each size (prompts seeded by the size, ids from `vocab`), each
    scheduled together; with data parallel, each batch whole on each DP rank in turn (`"<b>@dp<r>"`):
    vLLM balances requests over the ranks, and a batch split by timing would change its steps'
    shapes, so every rank's own tokens are kept."""
    out = {}
    for b in batch_sizes:
        for r in range(data_parallel) if data_parallel > 1 else [None]:
            key = str(b) if r is None else f"{b}@dp{r}"
            out[key] = await generate_together(llm, prompts(b, vocab, b), params, key, r)
    return out


async def decode_step_ms(llm: Any, batch: int, steps: int, repeats: int = 3, params: Any = None) -> float:
    """One decode step of `batch` requests, in ms: the time to `steps` tokens less the time to 1
    token, over `steps - 1`, for the same prompts scheduled together (the prefill, the same in
    both, cancels; the prompts are in the prefix cache for both); the median of `repeats`.
    `params(n)`: the sampling parameters of n greedy tokens (default: vLLM's)."""
    if params is None:
        from vllm import SamplingParams

        def params(n: int) -> Any:
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    batch_prompts = prompts(batch, 30000, 7000 + batch)
    runs = itertools.count()  # request ids stay unique

    async def timed(n: int) -> float:
        t = time.perf_counter()
        await generate_together(llm, batch_prompts, params(n), f"step{batch}-{next(runs)}")
        return time.perf_counter() - t

    await timed(1)  # the prompts into the prefix cache
    samples = []
    for _ in range(repeats):
        one, many = await timed(1), await timed(steps)
        samples.append((many - one) / (steps - 1) * 1e3)
    return round(sorted(samples)[len(samples) // 2], 4)


def main(args: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.compilation.counter import compilation_counter

    from ember.engines.vllm.args import NUMERICS

    t_import = time.perf_counter() - T0
    kwargs: dict[str, Any] = {}
    if args.get("kv_cache_memory_bytes"):
        kwargs["kv_cache_memory_bytes"] = int(args["kv_cache_memory_bytes"])
    t = time.perf_counter()
    llm = LLM(
        model=args["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        enforce_eager=False,
        gpu_memory_utilization=float(args["gpu_memory_utilization"]),
        max_model_len=2048,
        # Inductor's deterministic mode, as every pod of a deployment runs (args.NUMERICS)
        compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE", "inductor_compile_config": NUMERICS},
        **kwargs,
    )
    t_init = time.perf_counter() - t
    captured_at_start = compilation_counter.num_cudagraph_captured
    greedy = SamplingParams(
        max_tokens=int(args["max_tokens"]), temperature=0.0, ignore_eos=True, detokenize=False
    )
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    vcfg = llm.llm_engine.vllm_config
    vocab = int(vcfg.model_config.get_vocab_size())
    llm.generate(prompts(1, vocab, 0), first, use_tqdm=False)
    t_first = time.perf_counter() - T0
    tokens = {}
    t = time.perf_counter()
    for b in args["batch_sizes"]:
        outs = llm.generate(prompts(b, vocab, b), greedy, use_tqdm=False)
        tokens[str(b)] = [list(o.outputs[0].token_ids) for o in outs]
    cc = vcfg.compilation_config
    return {
        "vllm": vllm.__version__,
        "import_s": round(t_import, 3),
        "engine_init_s": round(t_init, 3),
        "first_token_s": round(t_first, 3),
        "generate_s": round(time.perf_counter() - t, 3),
        "graphs_captured_at_start": captured_at_start,
        "graphs_captured_serving": compilation_counter.num_cudagraph_captured - captured_at_start,
        "compilation_time_s": round(float(getattr(cc, "compilation_time", 0.0) or 0.0), 3),
        "cudagraph_mode": str(cc.cudagraph_mode),
        "capture_sizes": list(cc.cudagraph_capture_sizes or []),
        "kv_cache_memory_bytes": _kv_bytes(),
        "num_gpu_blocks": vcfg.cache_config.num_gpu_blocks,
        "v2_runner": bool(vcfg.use_v2_model_runner),
        "tokens": tokens,
    }


def _kv_bytes() -> int | None:
    """What the worker's determine_available_memory returned (the plugin's stage timing)."""
    try:
        from ember.engines.vllm.plugin import STATE

        return STATE.report["stages"]["worker.determine_available_memory"]["bytes"]
    except (ImportError, KeyError):
        return None


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    res = main(a)
    with open(a["out"], "w") as f:
        json.dump(res, f)
    print("CHILD OK", json.dumps({k: v for k, v in res.items() if k != "tokens"}))
