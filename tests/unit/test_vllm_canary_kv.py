"""The vLLM canary's FULL step over real KV slots, without vLLM or a GPU: where its tokens write and
read (`canary.kv_layout`), which engines' steps do (`canary.writes_kv`), how SAVE's record and
LOAD's plan keep steps that did and did not apart, and the `kv-write` fault that only such a step
shows (a dummy step's slots are PAD: leaving out the KV cache writes changes nothing it computes)."""

from __future__ import annotations

import numpy as np
import pytest

from ember.engines.vllm import canary, keys
from ember.engines.vllm.canary import EAGER, SAVED, Case
from ember.engines.vllm.keys import GraphConfig
from ember.runtime import faults

PLAIN = ["FullAttentionSpec"]


def _cases() -> list[Case]:
    sizes = keys.default_capture_sizes(16, 2048)
    return canary.cases(keys.enumerate_keys(GraphConfig("FULL_AND_PIECEWISE", tuple(sizes), max(sizes), 16,
                                                        runner="v1"), 3))


def test_every_token_writes_its_own_slot_in_the_last_blocks_and_every_request_reads_them_all() -> None:
    lay = canary.kv_layout(2, 16, 1000)
    assert lay.blocks == (999,) and lay.slots == (999 * 16, 999 * 16 + 1) and lay.seq_len == 2
    # more tokens than a block holds: the next block down, slots in order, no slot twice
    lay = canary.kv_layout(40, 16, 1000)
    assert lay.blocks == (999, 998, 997) and lay.seq_len == 40
    assert lay.slots[:17] == (*(999 * 16 + i for i in range(16)), 998 * 16)
    assert len(set(lay.slots)) == 40 and lay.slots[-1] == 997 * 16 + 7


def test_each_run_takes_blocks_no_earlier_run_wrote_until_they_run_out() -> None:
    """A graph that leaves out its KV writes must not read what the previous run wrote: each run
    its own blocks, from the last down, starting over before block 0."""
    runs = [canary.kv_layout(20, 16, 9, run).blocks for run in range(6)]
    assert runs[:4] == [(8, 7), (6, 5), (4, 3), (2, 1)] and runs[4:] == runs[:2]
    assert canary.kv_layout(2, 16, 1000, 3).slots == (996 * 16, 996 * 16 + 1)


def test_the_layout_never_reaches_the_null_block_and_refuses_what_does_not_fit() -> None:
    assert 0 not in canary.kv_layout(32, 16, 3).blocks  # blocks 2 and 1
    assert all(0 not in canary.kv_layout(5, 4, 6, run).blocks for run in range(10))
    for n, size, blocks in ((33, 16, 3), (0, 16, 10), (4, 0, 10), (1, 16, 1)):
        with pytest.raises(ValueError):
            canary.kv_layout(n, size, blocks)


def test_only_a_full_decode_step_of_one_token_requests_over_plain_attention_writes_kv() -> None:
    pw, full = _cases()
    assert canary.writes_kv(full, PLAIN, 1)
    assert canary.writes_kv(full, ["FullAttentionSpec", "SlidingWindowSpec"], 1)
    assert not canary.writes_kv(pw, PLAIN, 1)  # PIECEWISE: its pieces' prints cover q, k and v
    assert not canary.writes_kv(full, PLAIN, 2)  # a speculative decode step: more than one token a request
    assert not canary.writes_kv(full, ["FullAttentionSpec", "MambaSpec"], 1)  # state, not slots
    assert not canary.writes_kv(full, ["MLAAttentionSpec"], 1) and not canary.writes_kv(full, [], 1)


def test_saves_fingerprint_is_compared_only_with_a_step_that_wrote_kv_alike() -> None:
    pw, full = _cases()
    saved = canary.record([pw, full], {"piecewise": [1, 2], "full": [3]}, kv=["full"])
    assert saved["kind"] == canary.KIND and saved["cases"]["full"]["kv"] is True
    assert saved["cases"]["piecewise"]["kv"] is False
    assert canary.saved_fingerprint(saved, full, kv=True) == [3]
    assert canary.plan(full, 1, saved, True, kv=True) == SAVED
    # SAVE's step kept PAD slots, LOAD's writes KV (or the other way): not the same step
    assert canary.saved_fingerprint(saved, full, kv=False) is None
    assert canary.plan(full, 1, saved, True, kv=False) == EAGER
    before = canary.record([pw, full], {"piecewise": [1, 2], "full": [3]})
    assert canary.saved_fingerprint(before, full, kv=True) is None


def test_the_kv_write_fault_leaves_out_every_kv_cache_write_with_plain_edges_only() -> None:
    nodes = np.array([0, 2, 3, 5])
    names = ["_ZN4vllm30reshape_and_cache_flash_kernelIttLNS_18Fp8KVCacheDataTypeE0EEEvPKT_",
             "triton_poi_fused_mul_0", "reshape_and_cache_kernel_flash", "flash_fwd_splitkv_kernel"]
    src, dst = np.array([0, 2, 3]), np.array([2, 3, 5])
    plain = np.zeros(3, dtype=bool)
    assert faults.kv_writes_to_skip(nodes, names, src, dst, plain) == [0, 3]
    programmatic = np.array([False, False, True])  # 3 → 5 is programmatic: 3 is left alone
    assert faults.kv_writes_to_skip(nodes, names, src, dst, programmatic) == [0]
    mla = ["concat_and_cache_mla_kernel", *names[1:]]
    assert faults.kv_writes_to_skip(nodes, mla, src, dst, plain) == [0, 3]
    assert "kv-write" in faults.NAMES
