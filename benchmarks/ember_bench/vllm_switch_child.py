"""One vLLM engine of `ember bench vllm-switch` (a fresh process; argv[1] is its JSON arguments).

vLLM's async engine (what `vllm serve` runs; the offline `LLM` refuses DP > 1) built from the
identity's engine arguments, as `ember bench vllm --tp/--ep` builds it. Two roles:

- `serve` (the old shape): once its first token is out, a trickle of requests at a fixed rate,
  each sent on time whatever the earlier ones do (open loop), until the stop file appears; every
  request's send / done times (monotonic clock, the same clock in every process of the machine)
  and its outcome;
- `switch` (the new shape): the first token (one request, one token), its monotonic time written
  at once to the events file (the parent times switch → first token from it), then greedy tokens
  at each batch size: with data parallel ranks, each batch is sent to ONE DP rank at a time
  (vLLM's `data_parallel_rank`), so every DP rank's own outputs are compared; with tensor
  parallel alone, the engine's one output per request (made by every TP rank together).
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # before any import: process start → first token counts the imports too

import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

VOCAB = 30000  # prompt token ids below every model's vocabulary (as `ember bench vllm --tp`)


def event(path: str, **fields: Any) -> None:
    """Merge `fields` into the events file, atomically (the parent polls it)."""
    p = Path(path)
    try:
        merged = json.loads(p.read_text())
    except (OSError, ValueError):
        merged = {}
    merged.update(fields)
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(merged))
    os.replace(tmp, p)


def build(engine_args: list[str]) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    ns, _ = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).parse_known_args(engine_args)
    return AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(ns))


def params(n: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)


async def one(llm: Any, prompt: Any, n: int, rid: str, dp_rank: int | None = None) -> list[int]:
    last = None
    async for out in llm.generate(prompt, params(n), request_id=rid, data_parallel_rank=dp_rank):
        last = out
    return list(last.outputs[0].token_ids) if last is not None else []


async def batch(llm: Any, size: int, seed: int, n: int, dp_rank: int | None) -> list[list[int]]:
    """A batch's greedy tokens, its requests scheduled together (`generate_together`)."""
    from ember_bench.vllm_child import generate_together, prompts

    return await generate_together(llm, prompts(size, VOCAB, seed), params(n), f"b{size}-s{seed}-r{dp_rank}",
                                   dp_rank)


async def greedy(llm: Any, sizes: list[int], n: int, dp: int) -> dict[str, Any]:
    """Tokens per batch size; with DP ranks, per batch size and DP rank ("dp0", "dp1", ...)."""
    out: dict[str, Any] = {}
    for b in sizes:
        if dp > 1:
            out[str(b)] = {f"dp{r}": await batch(llm, b, b, n, r) for r in range(dp)}
        else:
            out[str(b)] = await batch(llm, b, b, n, None)
    return out


async def trickle(llm: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Requests at `interval_s` until the stop file exists; then the ones in flight finish."""
    from ember_bench.vllm_child import prompts

    stop, every, n = Path(args["stop"]), float(args["interval_s"]), int(args["trickle_tokens"])
    limit = float(args["request_timeout_s"])
    done: list[dict[str, Any]] = []
    log = open(args["requests_log"], "a", buffering=1)  # noqa: SIM115 - one line per request

    async def send(i: int) -> None:
        rec: dict[str, Any] = {"i": i, "sent": time.monotonic()}
        try:
            toks = await asyncio.wait_for(one(llm, prompts(1, VOCAB, 1000 + i)[0], n, f"t{i}"), limit)
            rec.update(ok=len(toks) == n, tokens=len(toks))
        except Exception as exc:  # a timeout or the engine's error: a failed request, not the end
            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
        rec["done"] = time.monotonic()
        done.append(rec)
        log.write(json.dumps(rec) + "\n")

    tasks, i, t_next = [], 0, time.monotonic()
    while not stop.exists():
        tasks.append(asyncio.create_task(send(i)))
        i, t_next = i + 1, t_next + every
        await asyncio.sleep(max(0.0, t_next - time.monotonic()))
    await asyncio.gather(*tasks)
    log.close()
    return sorted(done, key=lambda r: r["i"])


async def main(args: dict[str, Any]) -> dict[str, Any]:
    # vLLM and its engine's modules (imported lazily) count as import, as in `ember bench vllm`
    import vllm
    import vllm.engine.arg_utils
    import vllm.v1.engine.async_llm

    t_import = time.monotonic() - T0
    t = time.monotonic()
    llm = build(args["engine_args"])
    init = time.monotonic() - t
    await one(llm, {"prompt_token_ids": [11, 12, 13]}, 1, "first")
    first = time.monotonic()
    event(args["events"], start_mono=T0, first_token_mono=first)
    res: dict[str, Any] = {"vllm": vllm.__version__, "import_s": round(t_import, 3),
                           "engine_init_s": round(init, 3), "first_token_s": round(first - T0, 3),
                           "start_mono": T0, "first_token_mono": first}
    if args["role"] == "serve":
        res["served"] = sum(1 for r in await trickle(llm, args) if r.get("ok"))
    else:
        t = time.monotonic()
        res["tokens"] = await greedy(llm, args["batch_sizes"], int(args["max_tokens"]), int(args["dp"]))
        res["generate_s"] = round(time.monotonic() - t, 3)
    llm.shutdown()
    return res


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    result = asyncio.run(main(a))
    Path(a["out"]).write_text(json.dumps(result))
    print("CHILD OK", json.dumps({k: v for k, v in result.items() if k not in ("tokens", "requests")}),
          flush=True)
