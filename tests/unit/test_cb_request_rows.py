"""The rows LOAD's CB canary looks at (`ember.engines.transformers_cb.canary`): the one request's
real rows in batch order, never padding, sentinel or trash entries; on CPU tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from ember.engines.transformers_cb.canary import (  # noqa: E402
    GroupRows,
    batch_rows,
    block_table_rows,
    digest,
    request_rows,
    runs,
    written_digests,
    zero_rows,
)

BLOCK, BLOCKS = 4, 6
PAGES = BLOCK * BLOCKS  # allocatable rows 0..23; then the read-trash block, then the write trash
READ_TRASH, SENTINEL, WRITE_TRASH = PAGES, PAGES + 1, PAGES + BLOCK
SPECIAL = (READ_TRASH, SENTINEL, WRITE_TRASH)


def test_request_rows_keep_real_rows_in_batch_order() -> None:
    index = torch.tensor([13, 2, WRITE_TRASH, 7, SENTINEL, 0, READ_TRASH, WRITE_TRASH])
    assert request_rows(index, PAGES, SPECIAL).tolist() == [13, 2, 7, 0]  # not sorted: batch order


def test_request_rows_drop_every_special_value_even_inside_the_pages() -> None:
    # a layout where a special row were inside [0, pages) must still leave it out
    index = torch.tensor([5, 3, 9, 3])
    assert request_rows(index, PAGES, (3,)).tolist() == [5, 9]
    assert request_rows(torch.tensor([-1, 4, PAGES + 7]), PAGES, ()).tolist() == [4]


def test_block_table_rows_follow_logical_positions() -> None:
    blocks = torch.tensor([3, 1, -1, -1])
    rows = block_table_rows(blocks, BLOCK + 2, BLOCK)
    assert rows.tolist() == [12, 13, 14, 15, 4, 5]
    with pytest.raises(ValueError):
        block_table_rows(blocks, 2 * BLOCK + 1, BLOCK)


def _cache(groups: int) -> SimpleNamespace:
    return SimpleNamespace(num_blocks=BLOCKS, block_size=BLOCK, num_groups=groups,
                           read_trash_index=READ_TRASH, sentinel_index=SENTINEL,
                           write_trash_index=WRITE_TRASH)


def test_batch_rows_of_a_padded_prefill_hybrid_batch() -> None:
    """Group 0 full attention, group 1 sliding: one request of 2 tokens padded to q=4, kv=3."""
    write = torch.full((2, 8), WRITE_TRASH)
    read = torch.full((2, 16), READ_TRASH)
    write[0, :2] = torch.tensor([9, 8])
    write[1, :2] = torch.tensor([21, 20])
    read[0, :2] = torch.tensor([9, 8])
    read[1, :3] = torch.tensor([17, SENTINEL, SENTINEL])
    host = SimpleNamespace(use_block_table=False, num_q_tokens=4, max_kv_read=3,
                           write_index_storage=write, read_index_storage=read)
    full, sliding = batch_rows(host, _cache(2))
    assert full.written.tolist() == [9, 8] and sorted(full.touched.tolist()) == [8, 9]
    assert sliding.written.tolist() == [21, 20]
    assert sorted(sliding.touched.tolist()) == [17, 20, 21]


def test_batch_rows_without_reads_touch_what_they_write() -> None:
    write = torch.full((1, 8), WRITE_TRASH)
    write[0, 0] = 6
    host = SimpleNamespace(use_block_table=False, num_q_tokens=8, max_kv_read=0,
                           write_index_storage=write, read_index_storage=torch.full((1, 16), 0))
    (group,) = batch_rows(host, _cache(1))
    assert group.written.tolist() == [6] and group.touched.tolist() == [6]


def test_batch_rows_of_a_decode_batch_through_the_block_table() -> None:
    """One decode request (past = one block, query 1) padded to 4 sequences of the block table."""
    table = torch.full((1, 4, 3), -1, dtype=torch.int32)
    table[0, 0, :2] = torch.tensor([5, 2], dtype=torch.int32)
    cu_k = torch.tensor([0] + [BLOCK + 1] * 4)  # padding sequences: length 0
    host = SimpleNamespace(use_block_table=True, block_table=table,
                           cumulative_seqlens_q=torch.tensor([0, 1, 1, 1, 1]),
                           cumulative_seqlens_k={"full_attention": cu_k})
    (group,) = batch_rows(host, _cache(1))
    assert group.written.tolist() == [2 * BLOCK]  # block 2, offset 0: the new token
    assert group.touched.tolist() == [20, 21, 22, 23, 8]


def test_runs_split_rows_where_they_stop_being_consecutive() -> None:
    assert runs(torch.tensor([4, 5, 6, 2, 3, 9])) == [(4, 3), (2, 2), (9, 1)]
    assert runs(torch.tensor([7, 7])) == [(7, 1), (7, 1)]
    assert runs(torch.tensor([], dtype=torch.int64)) == []


def _kv(layers: int = 3) -> SimpleNamespace:
    """A cache of `layers` K and V tensors [rows, heads, dim] in bf16, every byte distinct-ish."""
    def layer(seed: int) -> object:
        rows = torch.arange(PAGES * 2 * 4, dtype=torch.float32).reshape(PAGES, 2, 4)
        return (rows + seed).to(torch.bfloat16)

    return SimpleNamespace(key_cache=[layer(i) for i in range(layers)],
                           value_cache=[layer(100 + i) for i in range(layers)])


def test_zero_rows_zeroes_every_touched_row_of_every_layer_and_nothing_else() -> None:
    cache, before = _kv(), _kv()
    touched = torch.tensor([3, 4, 9, 10, 11, 0])
    zero_rows(cache, [GroupRows(written=touched[:1], touched=touched)])
    after, old = (*cache.key_cache, *cache.value_cache), (*before.key_cache, *before.value_cache)
    layers = zip(after, old, strict=True)
    for t, b in layers:
        assert bool((t[touched] == 0).all())
        rest = [r for r in range(PAGES) if r not in touched.tolist()]
        assert torch.equal(t[rest], b[rest])


def test_written_digests_hash_rows_in_batch_order_whatever_blocks_hold_them() -> None:
    """SAVE and LOAD may place the request in other blocks: the digest is of the rows' bytes in
    batch order, so it is the same however the rows split into runs."""
    cache = _kv()
    rows = torch.tensor([4, 5, 6, 2, 3])
    k, v = written_digests(cache, [GroupRows(written=rows, touched=rows)])
    assert k == digest([torch.stack([t[rows] for t in cache.key_cache])])
    assert v == digest([torch.stack([t[rows] for t in cache.value_cache])])
    # the same bytes moved to one run of other rows digest the same
    moved = _kv()
    layers = zip((*moved.key_cache, *moved.value_cache), (*cache.key_cache, *cache.value_cache), strict=True)
    for t, src in layers:
        t[15:20] = src[rows]
    assert written_digests(moved, [GroupRows(written=torch.arange(15, 20), touched=rows)]) == [k, v]


def test_written_digests_see_one_changed_byte_and_the_order_of_rows() -> None:
    cache = _kv()
    rows = torch.tensor([4, 5, 6, 2, 3])
    group = [GroupRows(written=rows, touched=rows)]
    k, v = written_digests(cache, group)
    assert written_digests(cache, [GroupRows(written=rows.flip(0), touched=rows)])[0] != k
    cache.value_cache[2][6].view(torch.uint8)[1, 3] ^= 1
    assert written_digests(cache, group) == [k, written_digests(cache, group)[1]]
    assert written_digests(cache, group)[1] != v
    cache.key_cache[0][7] = 0  # a row the request did not write
    assert written_digests(cache, group)[0] == k
