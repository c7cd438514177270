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

No kernel of its own: a restored process has loaded none of torch's kernels yet, and each one's
first launch loads its module (10-20 ms on H200). The rows are zeroed through the byte fill that
poisons the outputs, and fingerprinted on the host (xxh3 over device-to-host copies of each run of
consecutive rows); on the GPU, gathering and summing them cost 81-121 ms in the first path
(benchmarks/results/h200-20261202).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

# What the canary fingerprints, recorded with SAVE's fingerprint: an archive whose canary is of
# another kind (before: word sums of the whole cache) is refused, not compared and called a fault.
KIND = "request-rows-xxh3"
# ...and in the identity (its `workload`), so an archive SAVEd with another kind is never found
# under a deployment's identity: after an upgrade the operator SAVEs again instead of every pod
# refusing the old archive and capturing natively.
IDENTITY_WORKLOAD = {"canary": KIND}


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


def runs(rows: Any) -> list[tuple[int, int]]:
    """Consecutive rows as (first, count), in their order: [4, 5, 6, 2, 3] -> [(4, 3), (2, 2)]."""
    out: list[tuple[int, int]] = []
    for r in rows.tolist():
        if out and out[-1][0] + out[-1][1] == r:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((r, 1))
    return out


def zero_rows(cache: Any, groups: list[GroupRows]) -> None:
    """Zero the touched rows of every layer's K and V (each cache tensor holds one layer per group)."""
    import torch

    for group in groups:
        for first, n in runs(group.touched):
            for t in (*cache.key_cache, *cache.value_cache):
                t[first : first + n].view(torch.uint8).fill_(0)


def written_digests(cache: Any, groups: list[GroupRows]) -> list[int]:
    """Per group, the digest of its layers' K rows as written (layer by layer, rows in batch
    order), then of its V rows."""
    spans = [runs(group.written) for group in groups]
    return [digest(t[first : first + n] for t in tensors for first, n in s)
            for s in spans for tensors in (cache.key_cache, cache.value_cache)]


def digest(tensors: Iterable[Any]) -> int:
    """xxh3-64 of the tensors' bytes, one after the other, hashed on the host: each contiguous
    tensor comes over in one device-to-host copy (no kernel)."""
    import torch
    import xxhash

    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).reshape(-1).cpu().numpy())
    return int(h.intdigest())

