"""`word_sums`, the KV-cache part of the CB canary: blind to where a block sits, not to what
was written, and the same whichever chunk size sums it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_word_sums_see_values_not_placement() -> None:
    import torch

    from ember.runtime.proof.replay import word_sums

    cache = torch.zeros(64, 16, 8, dtype=torch.bfloat16, device="cuda")
    block = torch.randn(16, 8, dtype=torch.bfloat16, device="cuda")
    here, there = cache.clone(), cache.clone()
    here[3], there[41] = block, block
    assert word_sums([here]) == word_sums([there])  # the same block, another place
    assert word_sums([here], chunk=7) == word_sums([here])  # chunking changes nothing

    off = here.clone()
    off[3, 5, 2] = off[3, 5, 2] * 2 + 1  # one value computed otherwise
    assert word_sums([off]) != word_sums([here])
