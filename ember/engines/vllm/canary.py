"""LOAD's canary for vLLM: what it runs and against which reference (torch-free, CPU-tested).

vLLM's graphs are not one graph per step: a PIECEWISE step launches one graph per compiled
submodule (attention runs eagerly between them), a FULL step one graph of the whole model. So the
canary checks whole STEPS (`Case`): a small PIECEWISE size (every piece of it) and a small FULL
size (a decode step, what the first request's second step needs). Each step runs
through vLLM's own dummy run (`_dummy_run`). The PIECEWISE step's slot mappings are PAD (it writes
no KV cache) and its block table rows are the ones a fresh engine has; the FULL step writes and
reads slots no request holds (below). The state every run starts from: input ids seeded (V1; V2's
dummy batch zeroes them itself), positions zero, the step's graph outputs poisoned
(`poison_targets`).

Why not the smallest step: a stale exec update (the template keeps the graph it held) that the
canary's round trip makes run a LARGER member's graph computes a superset of the step's rows, and
the rows the step reads come out the same. So each case is the second-smallest descriptor where
there is one, and its round trip goes through the next smaller member (`trip_member`): a stale
update then leaves rows of the step uncomputed, poisoned, and the canary differs.

The reference (`plan`):
- one GPU (SAVE saw real data): SAVE recorded a fingerprint of each case's step through the
  NATIVE graphs (`KIND`): its hidden states at the end, and each PIECEWISE piece's outputs as the
  piece returned them (`canary_run.piece_prints`: the q, k and v a piece hands to attention, which
  the dummy step's attention never reads, before a later piece reuses their memory); LOAD's
  restored step from the same state must give the same fingerprints. Graph against graph: the
  same kernels, bitwise;
- N ranks (SAVE played one rank under the NCCL stub and saw no data), or an archive without a
  fingerprint: the PIECEWISE step against the same step without graphs (`CUDAGraphMode.NONE`):
  vLLM runs the same compiled (Inductor) code eagerly, attention runs eagerly in both, and the
  collectives run on the same communicators the splice captured with. Each piece's outputs are
  fingerprinted in both steps too, at the same positions (`canary_run.Prints`). That covers every
  kernel of the piecewise graphs whose effect reaches the step's end or a piece's outputs, and
  the spliced collectives. A FULL step's attention is inside the graph with metadata built for
  capture, so its reference is an eager step built with the capture's metadata
  (`EMBER_VLLM_CANARY_FULL_EAGER`, on by default: bitwise equal on both ranks of TP=2 on H200,
  benchmarks/results/h200x2-20261201a; a difference refuses). With it off the FULL case is
  reported unchecked.
What a reset poisons: the step's graph outputs, and the SCRATCH its graphs write inside
(`scratch_ranges`): the graph pool's free memory their nodes point into. Outputs alone are not
enough: a kernel that leaves part of an internal buffer unwritten (a corrupted count) leaves what an
identical step computed there before, which is right, and the step's outputs come out right too
(vLLM's kernel-argument fault on both runners, benchmarks/results/h200-20261202c). SAVE records
each case's scratch and, on one GPU, fingerprints its steps with the scratch poisoned; a case whose
step reads its scratch before writing it (poisoned and plain runs differ) records none.
A FULL step's attention reads real KV (`kv_layout`): a dummy step's slot mappings are PAD, so it
writes no KV and attends over a fresh, zeroed cache, and its attention output would never depend
on the step's q, k and v. So the FULL case's one-token requests all write their token into slots of
the KV cache's last blocks (no request holds them in a fresh engine, and a request writes each
slot before it reads it) and all attend over those slots: every token's q, k and v reach every
request's output, inside one step. Each run takes blocks no earlier run wrote, so a graph that
leaves out its KV writes reads a cache nobody wrote, not what the reference step left there.
Engines whose KV cache groups are not plain attention (Mamba state, MLA, encoder-only) or whose
decode step is more than one token a request keep PAD slots (`writes_kv`), and that FULL step
stays blind to q, k and v.
What it cannot see: a wrong value that rounds away in bf16 against the residual stream changes
no fingerprint (a random-weight model's MLP adds ~1e-10 to a residual of ~1e-3); a kernel that
leaves its output unwritten does, through the poison (`POISON`).
Each restored step runs three ways (`ember.runtime.verify.canary`): through the templates (every
key of the step switched in: exec updates), again after each key's template went to another
member and back, and on the keys' own execs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ember.engines.vllm.keys import PIECEWISE_ENTRY, GraphKey

# The byte every reset writes over outputs and scratch: LARGE in every float width a step computes in
# (bf16 and fp32 ~1.5e16, fp16 203), as a positive int an index no buffer has. A buffer a faulty kernel
# leaves unwritten is read downstream as that value and must change the step's result; 0xA5 read as
# -2.9e-16 (bf16, fp32), which a random-weight model's MLP output, ~1e-10 beside a residual of ~1e-3,
# loses in bf16's rounding: the kernel-argument fault left it unwritten and the canary passed it
# (benchmarks/results/h100-20261202e).
POISON = 0x5A
# what SAVE's canary record fingerprints: whole dummy steps, their end and each PIECEWISE piece's
# outputs as the piece returned them, the FULL step over real KV slots (`kv_layout`)
# (an archive of another kind is checked against eager steps, `plan`)
KIND = "vllm-steps-kv"
# the KV cache groups whose slots a FULL canary step may write: plain paged attention
KV_SPECS = frozenset({"FullAttentionSpec", "SlidingWindowSpec"})
SEED = 13  # the canary's input ids (V1)
SAVED, EAGER, UNCHECKED = "saved", "eager", "unchecked"


@dataclass(frozen=True)
class Case:
    """One canary step: a batch descriptor and every graph it launches, in launch order."""

    name: str  # "piecewise" | "full"
    num_tokens: int
    uniform: bool
    keys: tuple[GraphKey, ...]

    @property
    def full(self) -> bool:
        return self.name.startswith("full")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "num_tokens": self.num_tokens, "uniform": self.uniform,
                "keys": [list(k) for k in self.keys]}


def cases(keys: Iterable[GraphKey], every_full: bool = False) -> list[Case]:
    """The canary's steps for an engine with these archive keys: the second-smallest PIECEWISE
    descriptor with all its pieces, and the second-smallest FULL descriptor (uniform decode ones
    first); the smallest where there is only one (see the module doc). `every_full` adds every other
    FULL descriptor of that kind as its own step, `full@<tokens>` (diagnosis: which size differs)."""
    keys = [tuple(k) for k in keys]
    out: list[Case] = []
    pw = [k for k in keys if k[0] == PIECEWISE_ENTRY]
    if pw:
        desc = _second(sorted({k[2:] for k in pw}))
        step = tuple(sorted((k for k in pw if k[2:] == desc), key=lambda k: k[1]))
        out.append(Case("piecewise", desc[0], bool(desc[2]), step))
    full = [k for k in keys if k[0] != PIECEWISE_ENTRY]
    if full:
        ordered = sorted([k for k in full if k[4]] or full, key=lambda k: (k[2], k[3]))
        k = _second(ordered)
        out.append(Case("full", k[2], bool(k[4]), (k,)))
        out += [Case(f"full@{o[2]}", o[2], bool(o[4]), (o,)) for o in ordered if every_full and o != k]
    return out


def _second(ordered: Sequence[Any]) -> Any:
    return ordered[1] if len(ordered) > 1 else ordered[0]


def trip_member(key: GraphKey, members: Sequence[GraphKey]) -> int | None:
    """Which of `members` (its topology group's keys) the round trip of `key` goes through: the
    largest one of fewer tokens, else the first other; None when the group has no other."""
    others = [i for i, m in enumerate(members) if tuple(m) != tuple(key)]
    smaller = [i for i in others if members[i][2] < key[2]]
    if smaller:
        return max(smaller, key=lambda i: members[i][2])
    return others[0] if others else None


@dataclass(frozen=True)
class KvLayout:
    """Where a FULL canary step of `n` one-token requests writes and reads the KV cache of one
    group: every request's block table row is `blocks`, token i writes `slots[i]`, and every
    request attends over all n slots (`seq_len`)."""

    blocks: tuple[int, ...]
    slots: tuple[int, ...]
    seq_len: int


def kv_layout(n: int, block_size: int, num_blocks: int, run: int = 0) -> KvLayout:
    """The layout of `n` tokens in a cache of `num_blocks` blocks of `block_size` slots, for the
    process's `run`-th such step: each run its own blocks, from the last down (never block 0:
    vLLM's null block, which padded rows point at). Its own, because a step that leaves out its
    KV writes would otherwise read what the previous run (the reference) wrote there, and pass."""
    need = -(-n // block_size) if block_size > 0 else 0
    if n < 1 or block_size < 1 or need >= num_blocks:
        raise ValueError(f"{n} tokens do not fit the last blocks of {num_blocks} x {block_size}")
    top = num_blocks - 1 - (run % ((num_blocks - 1) // need)) * need
    blocks = tuple(top - j for j in range(need))
    slots = tuple(blocks[i // block_size] * block_size + i % block_size for i in range(n))
    return KvLayout(blocks, slots, n)


def writes_kv(case: Case, specs: Sequence[str], query_len: int) -> bool:
    """Whether `case`'s step writes real KV (`kv_layout`): a FULL step of one-token requests over
    KV cache groups that are all plain paged attention (`KV_SPECS`, by their spec class names)."""
    return case.full and query_len == 1 and bool(specs) and all(s in KV_SPECS for s in specs)


def plan(case: Case, world: int, saved: Mapping[str, Any] | None, full_eager: bool,
         kv: bool = False) -> str:
    """The reference of `case`: SAVE's fingerprint (one GPU, recorded for this very step, `kv`
    alike), the step without graphs (PIECEWISE; FULL only with `full_eager`), or unchecked."""
    if world == 1 and saved_fingerprint(saved, case, kv) is not None:
        return SAVED
    if not case.full or full_eager:
        return EAGER
    return UNCHECKED


def record(cases_: Sequence[Case], prints: Mapping[str, list[int] | str],
           kv: Iterable[str] = ()) -> dict[str, Any]:
    """SAVE's canary record in the engine facts: per case its step, whether it wrote real KV
    (the cases named in `kv`) and its fingerprint (or why none)."""
    kv = set(kv)
    return {"kind": KIND, "cases": {c.name: {**c.to_json(), "kv": c.name in kv,
                                             "fingerprint": prints.get(c.name)} for c in cases_}}


def saved_fingerprint(saved: Mapping[str, Any] | None, case: Case, kv: bool = False) -> list[int] | None:
    """SAVE's fingerprint of exactly this step (same kind, descriptor, keys and KV writes: `kv`,
    what LOAD's step does), else None."""
    if not saved or saved.get("kind") != KIND:
        return None
    one = (saved.get("cases") or {}).get(case.name) or {}
    if [tuple(k) for k in one.get("keys") or []] != list(case.keys) or bool(one.get("kv")) != kv:
        return None
    if int(one.get("num_tokens", -1)) != case.num_tokens or bool(one.get("uniform")) != case.uniform:
        return None
    fp = one.get("fingerprint")
    return [int(x) for x in fp] if isinstance(fp, list) else None


def poison_targets(outputs: Sequence[tuple[int, int]], inputs: Iterable[int]) -> list[int]:
    """Which of a step's graph outputs (address, bytes) to poison before a run: every one that is
    not also a tensor argument of a graph of the step (a piece may update its input in place;
    poisoning that would change what the step computes, and not the eager reference's)."""
    reads = set(inputs)
    seen: set[int] = set()
    out = []
    for i, (ptr, size) in enumerate(outputs):
        if ptr in reads or ptr in seen or size <= 0:
            continue
        seen.add(ptr)
        out.append(i)
    return out


Range = tuple[int, int]  # (address, bytes)


def graph_pools(segments: Sequence[Mapping[str, Any]], outputs: Iterable[int]) -> set[tuple[int, ...]]:
    """The private pools (`segment_pool_id`) whose segments hold any of `outputs`."""
    pools = set()
    for ptr in outputs:
        for s in segments:
            if int(s["address"]) <= ptr < int(s["address"]) + int(s["total_size"]):
                pools.add(tuple(s.get("segment_pool_id") or (0, 0)))
    pools.discard((0, 0))
    return pools


def pool_blocks(segments: Iterable[Mapping[str, Any]], pools: set[tuple[int, ...]],
                state: str = "inactive") -> list[Range]:
    """The blocks of those pools (`graph_pools`: the CUDA graphs') in `state`, from
    `torch.cuda.memory_snapshot()`'s segments of this device. The scratch's are the free ones
    (no tensor holds them): at LOAD nothing but the restored graphs uses that memory, and no graph
    may rely on what a free block held before its own replay wrote it."""
    return sorted((int(b["address"]), int(b["size"])) for s in segments
                  if tuple(s.get("segment_pool_id") or (0, 0)) in pools
                  for b in s.get("blocks", []) if b.get("state") == state and int(b["size"]) > 0)


def block_states(segments: Sequence[Mapping[str, Any]], pools: set[tuple[int, ...]]) -> dict[str, int]:
    """Bytes per block state in those pools (the report: what the scratch could choose from)."""
    out: dict[str, int] = {}
    for s in segments:
        if tuple(s.get("segment_pool_id") or (0, 0)) in pools:
            for b in s.get("blocks", []):
                out[str(b.get("state"))] = out.get(str(b.get("state")), 0) + int(b["size"])
    return out


def scratch_ranges(pointers: Iterable[int], free: Sequence[Range], keep: Iterable[Range]) -> list[Range]:
    """The free blocks (`pool_blocks`) any of `pointers` (the step's graphs' argument
    words and memory node addresses) falls in, less the `keep` ranges (the step's tensor
    arguments: a piece may read one a previous piece or eager attention wrote), in address order."""
    starts = [b[0] for b in free]
    hit = set()
    for v in pointers:
        j = bisect.bisect_right(starts, v) - 1
        if j >= 0 and v < free[j][0] + free[j][1]:
            hit.add(free[j])
    out = []
    cuts = sorted((a, a + n) for a, n in keep if n > 0)
    for lo, size in sorted(hit):
        at, hi = lo, lo + size
        for c_lo, c_hi in cuts:
            if c_hi <= at or c_lo >= hi:
                continue
            if c_lo > at:
                out.append((at, c_lo - at))
            at = max(at, c_hi)
        if at < hi:
            out.append((at, hi - at))
    return out


def inside(span: Range, spans: Iterable[Range]) -> bool:
    """Whether `span` (address, bytes) lies within one of `spans`."""
    a, n = span
    return any(b <= a and a + n <= b + m for b, m in spans)


def within(ranges: Iterable[Sequence[int]], region: Sequence[int] | None) -> list[Range]:
    """The ranges inside libember's region (base, size): LOAD maps the graphs' memory there at
    SAVE's addresses; anything else is not poisoned (none without a region)."""
    if not region or len(region) < 2 or not region[1]:
        return []
    base, end = int(region[0]), int(region[0]) + int(region[1])
    return [(int(a), int(n)) for a, n in ranges if base <= int(a) and int(a) + int(n) <= end and int(n) > 0]


def combine(results: Mapping[str, dict[str, Any]], unchecked: Sequence[str] = ()) -> dict[str, Any]:
    """One verdict of several cases' `verify.canary` results (the first failure's reason), their
    costs summed, each part named by its case; unchecked cases named in `checked`."""
    why = next((f"{name}: {r['why']}" for name, r in results.items() if not r["ok"]), "")
    parts = {f"{name}.{part}": ms for name, r in results.items()
             for part, ms in r.get("parts_ms", {}).items()}
    checked = [f"{name}:{'+'.join(r.get('checked', []))}" for name, r in results.items()]
    checked += [f"{name}:unchecked" for name in unchecked]
    return {"ok": not why, "why": why, "checked": checked, "parts_ms": parts,
            "verify_ms": sum(float(r.get("verify_ms", 0.0)) for r in results.values()),
            "pieces": {name: r["pieces"] for name, r in results.items() if r.get("pieces")}}


def failed(why: str) -> dict[str, Any]:
    """A canary that could not run: a refusal, never a pass."""
    return {"ok": False, "why": why, "checked": [], "parts_ms": {}, "verify_ms": 0.0}


def skipped() -> dict[str, Any]:
    """`EMBER_VLLM_CANARY=0` (a bench's A/B): no canary ran, and the report's `checked` says so."""
    return {"ok": True, "why": "", "checked": ["skipped: EMBER_VLLM_CANARY=0"], "parts_ms": {},
            "verify_ms": 0.0}
