"""Key enumeration for transformers' continuous batching: every batch the scheduler can form lands
on an enumerated key, the ladders follow the engine's padding, and archive keys round-trip."""

from __future__ import annotations

import random

import pytest

from ember.engines.transformers_cb.hooks import archive_key, split_archive_key
from ember.engines.transformers_cb.keys import (
    FULL,
    MIN_SEQLEN_K,
    SLIDING,
    CBSizing,
    decode_keys,
    enumerate_keys,
    interval_ladder,
    key_of_batch,
    pad_to_interval,
    pad_to_pow2,
    pow2_ladder,
    varlen_keys,
)

SERVE = CBSizing(
    block_size=256,
    num_blocks=64,
    max_batch_tokens=1024,
    max_requests_per_batch=64,
    q_padding_interval_size=256,
    kv_padding_interval_size=4096,
)


def test_padding_helpers_match_the_engine_definitions() -> None:
    # transformers utils.pad_to_interval: 0 pads to one interval, results capped.
    assert pad_to_interval(0, 64, 8192) == 64
    assert pad_to_interval(65, 64, 8192) == 128
    assert pad_to_interval(9000, 64, 8192) == 8192
    assert pad_to_interval(5, 0, 77) == 77
    # pad_to_pow2 with a floor, capped (the cap need not be a power of two).
    assert pad_to_pow2(3, 510720, 1024) == 1024
    assert pad_to_pow2(3000, 510720, 1024) == 4096
    assert pad_to_pow2(400000, 510720, 1024) == 510720
    assert pad_to_pow2(5, 64) == 8


def test_ladders_are_exactly_the_padded_values() -> None:
    for interval, cap in [(256, 1024), (64, 1000), (4096, 16384), (3000, 16384)]:
        assert interval_ladder(interval, cap) == sorted(
            {pad_to_interval(x, interval, cap) for x in range(cap + 1)}
        )
    for cap, floor in [(16384, 1024), (510720, 1024), (64, 1), (100, 1)]:
        brute = sorted({pad_to_pow2(x, cap, floor) for x in range(1, 2 * cap)})
        assert pow2_ladder(cap, floor) == brute


def _random_batch(s: CBSizing, rng: random.Random) -> tuple[list[int], list[int]]:
    """A batch the scheduler could schedule: ≤ max_requests_per_batch requests, ≥ 1 query token
    each, queries within the token budget, reads within the cache budget, each request fitting
    the cache."""
    n = rng.randint(1, min(s.max_requests_per_batch, s.max_batch_tokens))
    q_total = rng.randint(n, s.max_batch_tokens)
    cuts = sorted(rng.sample(range(1, q_total), n - 1)) if n > 1 else []
    queries = [b - a for a, b in zip([0, *cuts], [*cuts, q_total], strict=True)]
    kv_budget = rng.choice([0, rng.randint(0, s.num_pages), s.num_pages, rng.randint(0, 3 * s.block_size)])
    pasts = []
    for q in queries:
        p = rng.randint(0, max(0, min(kv_budget, s.num_pages - q)))
        kv_budget -= p
        pasts.append(p)
    rng.shuffle(pasts)
    pasts = [min(p, s.num_pages - q) for p, q in zip(pasts, queries, strict=True)]
    return queries, pasts


@pytest.mark.parametrize(
    "sizing",
    [
        SERVE,
        CBSizing(
            block_size=256,
            num_blocks=128,
            max_batch_tokens=2048,
            max_requests_per_batch=32,
            q_padding_interval_size=512,
            kv_padding_interval_size=8192,
        ),
        CBSizing(
            block_size=32,
            num_blocks=100,
            max_batch_tokens=256,
            max_requests_per_batch=300,
            q_padding_interval_size=64,
            kv_padding_interval_size=1000,
        ),
        CBSizing(
            block_size=256,
            num_blocks=64,
            max_batch_tokens=1024,
            max_requests_per_batch=64,
            q_padding_interval_size=256,
            kv_padding_interval_size=4096,
            layer_types=(FULL, SLIDING),
            sliding_window=512,
        ),
    ],
)
def test_every_schedulable_batch_lands_on_an_enumerated_key(sizing: CBSizing) -> None:
    keys = set(enumerate_keys(sizing))
    rng = random.Random(7)
    for _ in range(4000):
        queries, pasts = _random_batch(sizing, rng)
        key = key_of_batch(sizing, queries, pasts)
        assert key in keys, (queries, pasts, key)


def test_enumeration_is_not_padded_with_impossible_lengths() -> None:
    keys = varlen_keys(SERVE)
    for q, kv, s in keys:
        # The longest key length can never exceed what q + kv tokens can make, padded.
        assert s <= pad_to_pow2(q + kv, SERVE.num_pages, MIN_SEQLEN_K)
        assert q in interval_ladder(256, 1024) and kv in interval_ladder(4096, SERVE.num_pages)
    # With at most 64 requests, 16k tokens of past cannot all sit in requests of ≤1024 tokens
    # when the batch has only a few query tokens... but 64 requests of 256 can: the floor key exists.
    assert (256, 16384, 1024) in keys
    assert len(keys) == len(set(keys))


def test_decode_keys_follow_pow2_padding_and_only_exist_with_a_block_table() -> None:
    assert decode_keys(SERVE) == []  # max_blocks_per_request = 0: no decode fast path (sdpa)
    s = CBSizing(
        block_size=256,
        num_blocks=64,
        max_batch_tokens=1024,
        max_requests_per_batch=48,
        q_padding_interval_size=256,
        kv_padding_interval_size=4096,
        max_blocks_per_request=32,
    )
    assert decode_keys(s) == [(1,), (2,), (4,), (8,), (16,), (32,), (48,)]
    for n in range(1, 49):
        assert key_of_batch(s, [1] * n, [300] * n, decode=True) in decode_keys(s)
    off = CBSizing(**{**s.to_json(), "layer_types": (FULL,), "use_cuda_graph_decode": False})
    assert decode_keys(off) == []


def test_coarser_intervals_shrink_the_key_set() -> None:
    fine = CBSizing(**{**SERVE.to_json(), "layer_types": (FULL,), "q_padding_interval_size": 64})
    coarse = CBSizing(**{**SERVE.to_json(), "layer_types": (FULL,), "q_padding_interval_size": 512})
    assert len(enumerate_keys(coarse)) < len(enumerate_keys(SERVE)) < len(enumerate_keys(fine))


def test_sizing_json_round_trip_and_validation() -> None:
    s = CBSizing(**{**SERVE.to_json(), "layer_types": (FULL, SLIDING), "sliding_window": 512, "io_pairs": 2})
    assert CBSizing.from_json(s.to_json()) == s
    with pytest.raises(ValueError, match="unknown CBSizing fields"):
        CBSizing.from_json({**s.to_json(), "bogus": 1})
    with pytest.raises(ValueError, match="sliding_window"):
        CBSizing(**{**SERVE.to_json(), "layer_types": (SLIDING,)})
    with pytest.raises(ValueError, match="num_blocks"):
        CBSizing(**{**SERVE.to_json(), "layer_types": (FULL,), "num_blocks": 0})


def test_archive_keys_carry_the_io_pair() -> None:
    assert archive_key(1, (256, 4096, 1024)) == (1, 256, 4096, 1024)
    assert split_archive_key((0, 8)) == (0, (8,))
    with pytest.raises(ValueError):
        split_archive_key((3, 8))
    with pytest.raises(ValueError):
        split_archive_key((0,))
