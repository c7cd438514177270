"""CPU (torch): the vLLM canary's resets (`canary_run.Steps.reset`), with stand-in graph outputs.

Every path of a case starts from a reset that poisons the step's graph outputs. They are tensors
over SAVE's addresses, rebuilt from the archive's specs: 1–2 ms for a full-depth step's ~70
(h200-20261201c), so a case's are rebuilt once, not at each reset. What is poisoned must not
change: every output, except one a graph of the step also reads."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ember.engines.vllm import canary_run  # noqa: E402  (after the torch check)
from ember.engines.vllm.canary import Case  # noqa: E402


def test_a_case_rebuilds_its_outputs_once_and_poisons_them_at_every_reset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    memory = {name: torch.zeros(8, dtype=torch.bfloat16) for name in ("1,0,2", "1,1,2", "1,2,2")}
    rebuilt: list[str] = []

    def rebuild(spec: Any) -> Any:
        rebuilt.append(spec["name"])
        return (memory[spec["name"]],)

    monkeypatch.setattr(canary_run.sites, "rebuild", rebuild)
    keys = ((1, 0, 2), (1, 1, 2), (1, 2, 2))
    facts = {"outputs": {",".join(map(str, k)): {"name": ",".join(map(str, k))} for k in keys},
             # piece 2 reads piece 1's output (an in-place update): poisoning it would change the step
             "input_addresses": {"1,2,2": [memory["1,1,2"].data_ptr()]}}
    steps = canary_run.Steps(runner=None, kind="v2", facts=facts)
    case = Case("piecewise", 2, False, keys)

    for _ in range(5):
        for t in memory.values():
            t.fill_(1.0)  # what a path's step left there
        steps.reset(case)
        poisoned = {n: bool((t.view(torch.uint8) == canary_run.POISON).all()) for n, t in memory.items()}
        assert poisoned == {"1,0,2": True, "1,1,2": False, "1,2,2": True}
    assert rebuilt == ["1,0,2", "1,1,2", "1,2,2"]  # once, not once a reset

    other = Case("full", 2, True, keys[:1])
    steps.reset(other)
    assert rebuilt[3:] == ["1,0,2"]  # another case rebuilds its own


def test_outputs_of_every_size_and_dtype_are_poisoned_whole_and_a_strided_one_filled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each output's own bytes are poisoned, whatever its size and element type, and none past
    it; a strided output cannot be viewed as bytes, so it is filled (-3) instead."""
    base, pool = torch.zeros(4, 6), torch.ones(10, dtype=torch.bfloat16)
    memory = {"1,0,2": pool[:3], "1,1,2": torch.zeros(2, 5, dtype=torch.float32),
              "1,2,2": torch.zeros(7, dtype=torch.int64), "1,3,2": base.t()}
    monkeypatch.setattr(canary_run.sites, "rebuild", lambda spec: (memory[spec["name"]],))
    keys = tuple((1, i, 2) for i in range(4))
    facts = {"outputs": {",".join(map(str, k)): {"name": ",".join(map(str, k))} for k in keys}}
    steps = canary_run.Steps(runner=None, kind="v2", facts=facts)
    steps.reset(Case("piecewise", 2, False, keys))
    for name in ("1,0,2", "1,1,2", "1,2,2"):
        assert bool((memory[name].view(torch.uint8) == canary_run.POISON).all()), name
    assert bool((base == -3).all())
    assert bool((pool[3:] == 1).all())  # the memory past an output stays as it was
    # each piece's returned outputs compared where a reset sets them whole: not the strided one
    assert steps.compared(Case("piecewise", 2, False, keys)) == [[0], [0], [0], []]


def test_a_reset_poisons_the_cases_scratch_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scratch (what a step's graphs write inside, SAVE's ranges) is poisoned at every reset:
    a kernel that leaves part of it unwritten then leaves poison, not what an identical step left
    there. SAVE's plain runs (`scratch=False`) leave it alone. Its views are made once per case."""
    memory = torch.ones(64, dtype=torch.uint8)
    made: list[tuple[int, int]] = []

    def bytes_at(address: int, nbytes: int) -> Any:
        made.append((address, nbytes))
        return memory[address : address + nbytes]

    monkeypatch.setattr(canary_run, "_bytes_at", bytes_at)
    monkeypatch.setattr(canary_run.sites, "rebuild", lambda spec: None)
    keys = ((1, 0, 2),)
    facts = {"outputs": {"1,0,2": None}}
    steps = canary_run.Steps(runner=None, kind="v2", facts=facts, scratch={"piecewise": [[8, 8], [32, 4]]})
    case = Case("piecewise", 2, False, keys)

    steps.reset(case, scratch=False)
    assert bool((memory == 1).all())
    for _ in range(3):
        memory.fill_(1)
        steps.reset(case)
        poisoned = (memory == canary_run.POISON).nonzero().flatten().tolist()
        assert poisoned == [*range(8, 16), *range(32, 36)]
    assert made == [(8, 8), (32, 4)]
    assert steps.scratch(Case("full", 2, True, keys)) == []  # a case without scratch


class _V2Runner:
    """vLLM's V2 runner as the canary's FULL step meets it: a dummy batch of n one-token requests
    (sequence length 1), dummy attention inputs (PAD slots, a fresh engine's rows), then attention,
    which records what it was given."""

    def __init__(self, specs: tuple[str, ...] = ("FullAttentionSpec",), query: int = 1) -> None:
        groups = [SimpleNamespace(kv_cache_spec=type(s, (), {})()) for s in specs]
        self.kv_cache_config = SimpleNamespace(num_blocks=64, kv_cache_groups=groups)
        self.decode_query_len = query
        self.block_tables = SimpleNamespace(cp_size=1, kernel_block_sizes=[16] * len(specs),
                                            blocks_per_kv_block=[1] * len(specs),
                                            input_block_tables=[torch.zeros(8, 4, dtype=torch.int32)
                                                                for _ in specs],
                                            slot_mappings=torch.zeros(len(specs), 32, dtype=torch.int64))
        self.seq_lens = torch.zeros(8, dtype=torch.int32)
        self.seen: list[dict[str, Any]] = []

    def prepare_dummy_attn(self, batch: Any) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        self.block_tables.slot_mappings.fill_(-1)
        bts = self.block_tables.input_block_tables
        return tuple(t[: batch.num_reqs] for t in bts), self.block_tables.slot_mappings[:, : batch.num_tokens]

    def _dummy_run(self, n: int, **_: Any) -> tuple[torch.Tensor, None]:
        self.seq_lens[:n] = 1
        batch = SimpleNamespace(num_reqs=n, num_tokens=n, seq_lens=self.seq_lens[:n],
                                seq_lens_cpu_upper_bound=torch.ones(n, dtype=torch.int32))
        tables, slots = self.prepare_dummy_attn(batch)
        self.seen.append({"rows": [t[:n, :1].flatten().tolist() for t in tables], "slots": slots.tolist(),
                          "seq_lens": batch.seq_lens.tolist(),
                          "bound": batch.seq_lens_cpu_upper_bound.tolist()})
        return torch.zeros(n, 4), None


def test_the_full_step_writes_and_reads_slots_of_the_last_block_and_the_piecewise_step_none() -> None:
    """The FULL step's requests each write their token into the cache's last block and all attend
    over those slots, set before attention's metadata is built (what the backend plans for); after
    the step the runner's own method is back and the next dummy step is vLLM's again."""
    runner = _V2Runner(("FullAttentionSpec", "SlidingWindowSpec"))
    steps = canary_run.Steps(runner, "v2", {})
    full = Case("full", 2, True, ((2, 2, 1, 2, 1),))
    assert steps.writes_kv(full)
    steps.run(full, graphs=True)
    seen = runner.seen[-1]
    assert seen["rows"] == [[63, 63], [63, 63]] and seen["slots"] == [[63 * 16, 63 * 16 + 1]] * 2
    assert seen["seq_lens"] == [2, 2] and seen["bound"] == [2, 2]
    assert "prepare_dummy_attn" not in vars(runner)
    assert not any(t.any() for t in runner.block_tables.input_block_tables)  # a fresh engine's rows again
    # the next run takes blocks no earlier run wrote: a step that leaves out its KV writes must
    # not read what the previous one (the reference) left there
    steps.run(full, graphs=False)
    assert runner.seen[-1]["rows"] == [[62, 62], [62, 62]] and steps.kv_runs == 2
    runner._dummy_run(2)  # vLLM's own dummy step after the canary: PAD slots, length 1
    assert runner.seen[-1]["slots"] == [[-1, -1]] * 2 and runner.seen[-1]["seq_lens"] == [1, 1]


@pytest.mark.parametrize("specs,query", [(("FullAttentionSpec", "MambaSpec"), 1),
                                         (("FullAttentionSpec",), 2)])
def test_an_engine_whose_cache_is_not_plain_attention_keeps_pad_slots(specs: tuple[str, ...],
                                                                      query: int) -> None:
    runner = _V2Runner(specs, query)
    steps = canary_run.Steps(runner, "v2", {})
    full = Case("full", 2, True, ((2, 2, 1, 2, 1),))
    assert not steps.writes_kv(full)
    steps.run(full, graphs=True)
    assert runner.seen[-1]["slots"][0] == [-1, -1] and runner.seen[-1]["seq_lens"] == [1, 1]


def test_v1_writes_the_slots_after_its_dummy_run_padded_them_and_before_the_metadata_is_built() -> None:
    seen: list[Any] = []

    class V1Runner:
        def __init__(self) -> None:
            bt = SimpleNamespace(block_table=SimpleNamespace(gpu=torch.zeros(8, 4, dtype=torch.int32)),
                                 block_size=16, blocks_per_kv_block=2)  # a kernel block is half a block
            self.input_batch = SimpleNamespace(block_table=[bt])
            self.kv_cache_config = SimpleNamespace(num_blocks=10)
            self.seq_lens = torch.zeros(8, dtype=torch.int32)
            self.optimistic_seq_lens_cpu = torch.zeros(8, dtype=torch.int32)
            self.slots = torch.zeros(32, dtype=torch.int64)

        def _build_attention_metadata(self, num_tokens: int, slot_mappings: dict[int, Any]) -> None:
            bt = self.input_batch.block_table[0].block_table.gpu
            seen.append((bt[:num_tokens, 0].tolist(), slot_mappings[0][:num_tokens].tolist(),
                         self.seq_lens[:num_tokens].tolist(),
                         self.optimistic_seq_lens_cpu[:num_tokens].tolist()))

        def step(self, n: int) -> None:  # V1's `_dummy_run`: PAD slots, length 1, then the metadata
            self.slots.fill_(-1)
            self.seq_lens[:n] = 1
            self.optimistic_seq_lens_cpu[:n] = 1
            self._build_attention_metadata(num_tokens=n, slot_mappings={0: self.slots[:n]})

    runner = V1Runner()
    with canary_run.real_kv(runner, "v1", 3, 0):
        runner.step(3)
    runner.step(3)
    with canary_run.real_kv(runner, "v1", 3, None):
        runner.step(3)
    with canary_run.real_kv(runner, "v1", 3, 1):  # the next run: the next block down
        runner.step(3)
    assert seen[0] == ([19, 19, 19], [19 * 16, 19 * 16 + 1, 19 * 16 + 2], [3, 3, 3], [3, 3, 3])
    assert seen[1][1:] == seen[2][1:] == ([-1, -1, -1], [1, 1, 1], [1, 1, 1])
    assert seen[3][:2] == ([18, 18, 18], [18 * 16, 18 * 16 + 1, 18 * 16 + 2])


def test_a_runner_whose_kv_cache_is_not_where_vllm_026_keeps_it_keeps_pad_slots(
        caplog: pytest.LogCaptureFixture) -> None:
    """Another vLLM (no `kv_cache_config`, or a context-parallel cache): the FULL step keeps PAD
    slots, said in the log, instead of failing the canary."""
    full = Case("full", 2, True, ((2, 2, 1, 2, 1),))
    assert not canary_run.Steps(SimpleNamespace(), "v1", {}).writes_kv(full)
    assert "writes no KV here" in caplog.text
    split = _V2Runner()
    split.block_tables.cp_size = 2
    assert not canary_run.Steps(split, "v2", {}).writes_kv(full)
