"""CPU (numpy stands in for torch): vLLM's vocabulary-parallel embedding mask with the shard's
bounds read from an array computes the same integers as vLLM's `get_masked_input_and_mask` with
Python ints, for every rank's shard (padding and added vocabulary included)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ember.engines.vllm.parallel import masked_input_and_mask, vocab_bounds


def _vllm(input_: np.ndarray, start: int, end: int, pad: int, a_start: int, a_end: int) -> tuple:
    """vocab_parallel_embedding.py get_masked_input_and_mask (0.26), verbatim but for torch."""
    org_vocab_mask = (input_ >= start) & (input_ < end)
    added_vocab_mask = (input_ >= a_start) & (input_ < a_end)
    added_offset = a_start - (end - start) - pad
    valid_offset = (start * org_vocab_mask) + (added_offset * added_vocab_mask)
    vocab_mask = org_vocab_mask | added_vocab_mask
    return vocab_mask * (input_ - valid_offset), ~vocab_mask


@pytest.mark.parametrize("shard", [(0, 64000, 0, 128256, 128256), (64000, 128256, 0, 128256, 128256),
                                   (75968, 151936, 0, 151936, 151936), (50, 100, 4, 120, 130)])
def test_bounds_from_memory_mask_as_vllm_does(shard: tuple[int, ...]) -> None:
    ids = np.arange(0, 152000, 7, dtype=np.int32)
    indices = SimpleNamespace(org_vocab_start_index=shard[0], org_vocab_end_index=shard[1],
                              num_org_vocab_padding=shard[2], added_vocab_start_index=shard[3],
                              added_vocab_end_index=shard[4])
    bounds = np.array(vocab_bounds(indices), dtype=np.int64)
    got, got_mask = masked_input_and_mask(ids, bounds)
    want, want_mask = _vllm(ids, *shard)
    assert np.array_equal(got, want) and np.array_equal(got_mask, want_mask)
