"""Are the CAPTURED graphs bit-stable on their own? (no libember; one process per mode)

    python3 benchmarks/results/diag/diag_determinism.py [sizes] [layers]          # default torch settings
    CUBLAS_WORKSPACE_CONFIG=:4096:8 DIAG_DET=1 python3 benchmarks/results/diag/diag_determinism.py ...

Per size: capture natively, replay REPEATS times from one state (ids, pos, step and the KV
cache restored), compare logits/tokens bitwise (max |diff| where not). For an unstable size, the
same step runs eagerly twice with forward hooks on every module: the first module whose output
differs names the op (e.g. a GEMM shape) that is not deterministic. One JSON line per finding,
flushed as it comes (a timeout still leaves what was found).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import torch

from ember.engines.decode.model import DecodeWorkload

REPEATS = 8


def emit(**kw: object) -> None:
    print(json.dumps(kw, default=str), flush=True)


def main() -> None:
    sizes = tuple(int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "1,16,24,32").split(","))
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    det = os.environ.get("DIAG_DET") == "1"
    torch.cuda.init()
    w = DecodeWorkload.from_name("llama3-8b", sizes=sizes, layers=layers or None, deterministic=det)
    w.build()
    w.capture()
    emit(
        mode="deterministic" if det else "default",
        cublas_ws=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        device=torch.cuda.get_device_name(),
        layers=w.spec.layers,
        sizes=sizes,
    )
    state = [w.ids, w.pos, w.step_no, w.kcache, w.vcache]
    w.reset_state(5)
    for _ in range(3):  # some history in the KV cache, like a running decode
        w.graphs[(max(sizes),)].replay()
    snap = [t.clone() for t in state]

    def restore() -> None:
        for t, v in zip(state, snap, strict=True):
            t.copy_(v)

    unstable = []
    for b in sizes:
        outs = []
        for _ in range(REPEATS):
            restore()
            w.graphs[(b,)].replay()
            torch.cuda.synchronize()
            outs.append([o.clone() for o in w.outs[(b,)]])
        diff = [k for k in range(1, REPEATS) if not _equal(outs[0], outs[k])]
        ref = outs[0]
        logits = max(((ref[0].float() - outs[k][0].float()).abs().max().item() for k in diff), default=0.0)
        tok = max((int((ref[1] != outs[k][1]).sum()) for k in diff), default=0)
        emit(size=b, graph_bit_stable=not diff, differing_replays=len(diff), logits_maxabs=logits, tokens=tok)
        if diff:
            unstable.append(b)
    for b in unstable[:2]:
        emit(size=b, **_first_eager_difference(w, b, restore))
    restore()


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _first_eager_difference(w: DecodeWorkload, b: int, restore: Callable[[], None]) -> dict[str, object]:
    """Run the step eagerly twice with hooks on every module; the first module whose output differs."""
    records: list[dict[str, torch.Tensor]] = [{}, {}]
    run = [0]

    def hook(name: str) -> Callable[..., None]:
        def f(_m: object, _i: object, out: object) -> None:
            if isinstance(out, torch.Tensor):
                records[run[0]][name] = out.detach().clone()

        return f

    assert w.model is not None
    handles = [m.register_forward_hook(hook(n)) for n, m in w.model.named_modules() if n]
    for r in range(2):
        run[0] = r
        restore()
        with torch.no_grad():
            w.step(b)
        torch.cuda.synchronize()
    for h in handles:
        h.remove()
    first = next((n for n in records[0] if not torch.equal(records[0][n], records[1][n])), None)
    module = dict(w.model.named_modules()).get(first) if first else None
    return {
        "eager_first_differing_module": first,
        "module": repr(module)[:120] if module is not None else None,
        "output_shape": list(records[0][first].shape) if first else None,
        "eager_modules": len(records[0]),
    }


if __name__ == "__main__":
    main()
