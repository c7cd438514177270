"""The KV-cache rows LOAD's canary looks at: those its one synthetic request writes and reads.

The canary (`hooks.ManagerHooks.canary`) zeroes these rows before each launch and fingerprints
the rows the request wrote, in batch order, so its cost does not grow with the cache (CB sizes
the cache to fill the GPU) and SAVE and LOAD agree whichever physical blocks the request got.

transformers 5.17 (`generation/continuous_batching/`): the cache tensors are shared by the layer
groups (`cache.key_cache[j]` holds layer j of every group, each group in its own blocks); per
group, the batch's `write_index` lists the row each query token writes (batch order) and its
`read_index` the rows attention reads (`cache.update`). Padding tokens write to the write-trash
row and read the read-trash row; sliding groups mark a new token's read slot with the sentinel.
All three lie past the allocatable rows (`num_blocks * block_size`), which a request's rows never
do. The decode fast path (full attention only) has no indices: each group's block table maps the
request's logical positions to blocks.

The rows come from the host-side tensors the batch was prepared from, read before the launch,
so a graph computing wrongly cannot change which rows are looked at.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

# What the canary fingerprints, recorded with SAVE's fingerprint: an archive whose canary is of
# another kind (before: word sums of the whole cache) is refused, not compared and called a fault.
KIND = "request-rows"


@dataclass(frozen=True)
class GroupRows:
    """One layer group's rows for the canary's request (CPU int64 tensors)."""

    written: Any  # the rows the request's tokens write, in batch order
    touched: Any  # every row it writes or reads: what the canary zeroes before a launch


def request_rows(index: Any, pages: int, special: Collection[int]) -> Any:
    """The entries of a 1-D index tensor that address an allocatable cache row, in their order:
    in [0, pages) and none of `special` (sentinel, read and write trash: padding and new-token
    slots). A pure function of its arguments (CPU tensors in the unit tests)."""
    import torch

    index = index.reshape(-1).to(torch.int64)
    keep = (index >= 0) & (index < pages)
    for value in special:
        keep &= index != value
    return index[keep]


def block_table_rows(blocks: Any, length: int, block_size: int) -> Any:
    """The rows of logical positions 0..length-1 through one request's block-table row."""
    import torch

    pos = torch.arange(length, dtype=torch.int64)
    ids = blocks.reshape(-1).to(torch.int64)[pos // block_size]
    if bool((ids < 0).any()):
        raise ValueError(f"block table row {blocks.tolist()} has no block for {length} positions")
    return ids * block_size + pos % block_size


def batch_rows(host: Any, cache: Any) -> list[GroupRows]:
    """Per layer group, the rows of the one real request in the batch `host` (the engine's IO the
    batch was prepared into: the host IO of async batching, the IO itself otherwise) uses."""
    pages = int(cache.num_blocks) * int(cache.block_size)
    special = {int(cache.read_trash_index), int(cache.sentinel_index), int(cache.write_trash_index)}
    if host.use_block_table:
        # request 0 of a decode batch: key length past + query, the query at its end
        cu_k = host.cumulative_seqlens_k["full_attention"][:2].tolist()
        cu_q = host.cumulative_seqlens_q[:2].tolist()
        length, query = cu_k[1] - cu_k[0], cu_q[1] - cu_q[0]
        out = []
        for g in range(int(cache.num_groups)):
            rows = block_table_rows(host.block_table[g, 0].cpu(), length, int(cache.block_size))
            out.append(GroupRows(written=rows[length - query :], touched=rows))
        return out
    q, kv = int(host.num_q_tokens), int(host.max_kv_read)
    out = []
    for g in range(int(cache.num_groups)):
        written = request_rows(host.write_index_storage[g, :q].cpu(), pages, special)
        read = request_rows(host.read_index_storage[g, : kv + q].cpu(), pages, special) if kv else written
        out.append(GroupRows(written=written, touched=_union(written, read)))
    return out


def _union(a: Any, b: Any) -> Any:
    import torch

    return torch.unique(torch.cat([a, b]))


def zero_rows(cache: Any, groups: list[GroupRows]) -> None:
    """Zero the touched rows of every layer's K and V (each cache tensor holds one layer per group)."""
    for group in groups:
        rows = group.touched.to(cache.key_cache[0].device)
        for t in (*cache.key_cache, *cache.value_cache):
            t.index_fill_(0, rows, 0)


def written_kv(cache: Any, groups: list[GroupRows]) -> list[Any]:
    """Per group, its layers' K rows then V rows as written, stacked ([layers, rows, heads, dim])."""
    import torch

    out = []
    for group in groups:
        rows = group.written.to(cache.key_cache[0].device)
        for tensors in (cache.key_cache, cache.value_cache):
            out.append(torch.stack([t.index_select(0, rows) for t in tensors]))
    return out
