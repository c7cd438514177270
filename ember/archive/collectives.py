"""The archive's collective table (manifest engine facts, key "collectives"): where a graph
saved on one GPU for a world of several ranks holds collective placeholders, and what each one
is. Written by SAVE (`ember.runtime.comm.placeholders`), spliced by every rank's LOAD
(`ember.runtime.comm.Splicer`), shown by `ember inspect`. Nothing in it is per rank.

An engine may issue collectives on several communicators (vLLM: one per parallel group of more
than one rank: tensor, data, expert). `comms` names each by its group, in a way every rank
agrees on (vLLM's group name, e.g. "tp:0", and its size); each call says which one by index.
A table without `comms` (saved before groups were recorded) has one communicator of the whole
world, named `WORLD`, which is what ember's decode workloads use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# ncclDataType_t and ncclRedOp_t (nccl.h): only for people reading `ember inspect`.
DTYPES = {
    0: "int8",
    1: "uint8",
    2: "int32",
    3: "uint32",
    4: "int64",
    5: "uint64",
    6: "float16",
    7: "float32",
    8: "float64",
    9: "bfloat16",
    10: "float8_e4m3",
    11: "float8_e5m2",
}
REDOPS = {-1: "", 0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
DTYPE_BYTES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}
PER_RANK = ("all_gather", "all_to_all")  # their receive buffer holds `count` elements per rank
WORLD = "world"  # the one communicator of a table saved without groups
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "reduce", "broadcast", "send", "recv")


@dataclass(frozen=True)
class Call:
    """One NCCL call as rank 0 issued it at SAVE."""

    op: str
    send: int
    recv: int
    count: int
    dtype: int
    redop: int = -1
    root: int = -1  # root (reduce, broadcast) or peer (send, recv)
    comm: int = 0  # index into `Collectives.comms` (not the stub's per-process communicator id)

    @classmethod
    def from_record(cls, rec: Mapping[str, Any], comm: int = 0) -> Call:
        """From one of libember_nccl's call records (`ember_nccl_calls`); `comm`: the index of its
        communicator's group in the table."""
        return cls(rec["op"], int(rec["send"]), int(rec["recv"]), int(rec["count"]), int(rec["dtype"]),
                   int(rec["redop"]), int(rec["root"]), comm)

    def received(self, nranks: int) -> tuple[int, int] | None:
        """(address, bytes) of the buffer the call writes on a rank of `nranks`; None: none, or
        of a datatype this table does not know the size of."""
        if self.op == "send" or not self.recv or self.dtype not in DTYPE_BYTES:
            return None
        count = self.count * (nranks if self.op in PER_RANK else 1)
        return self.recv, count * DTYPE_BYTES[self.dtype]

    def describe(self) -> str:
        red = f" {REDOPS.get(self.redop, self.redop)}" if self.redop >= 0 else ""
        root = f" root/peer={self.root}" if self.root >= 0 else ""
        return f"{self.op}{red} {self.count} x {DTYPES.get(self.dtype, self.dtype)}{root}"


@dataclass(frozen=True)
class CommGroup:
    """One communicator of the table, as every rank names it: its group and the group's size."""

    name: str
    nranks: int


@dataclass
class Collectives:
    """The archive's collective table: `table[i]` is one placeholder (several calls when they were
    grouped), `nodes[g]` the (node index, table index) pairs of graph g (in the table's order),
    `comms` the communicators the calls name (`Call.comm`)."""

    world: int
    nccl_version: str
    table: list[tuple[Call, ...]]
    nodes: dict[int, list[tuple[int, int]]]
    comms: list[CommGroup] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.comms:  # a table saved before groups were recorded: the whole world's one
            self.comms = [CommGroup(WORLD, self.world)]

    def to_facts(self) -> dict[str, Any]:
        return {
            "world": self.world,
            "nccl_version": self.nccl_version,
            "comms": [asdict(c) for c in self.comms],
            "table": [[asdict(c) for c in calls] for calls in self.table],
            "nodes": {str(g): [list(p) for p in pairs] for g, pairs in self.nodes.items()},
        }

    @classmethod
    def from_facts(cls, facts: Mapping[str, Any]) -> Collectives:
        return cls(
            world=int(facts["world"]),
            nccl_version=str(facts.get("nccl_version", "")),
            table=[tuple(Call(**c) for c in calls) for calls in facts["table"]],
            nodes={int(g): [(int(n), int(i)) for n, i in pairs] for g, pairs in facts["nodes"].items()},
            comms=[CommGroup(str(c["name"]), int(c["nranks"])) for c in facts.get("comms") or ()],
        )

    def comm_of(self, i: int) -> int:
        """The communicator (index into `comms`) of placeholder i (one per placeholder: SAVE
        refuses a group of calls spanning several)."""
        return self.table[i][0].comm

    def received(self) -> dict[int, list[tuple[int, int]]]:
        """Per graph index, the buffers its placeholders' calls write, (address, bytes) each:
        under the stub nothing writes them, so SAVE's proof sets them before every replay."""
        out: dict[int, list[tuple[int, int]]] = {}
        for g, pairs in self.nodes.items():
            spans = (c.received(self.comms[c.comm].nranks) for _, i in pairs for c in self.table[i])
            out[g] = sorted({s for s in spans if s is not None})
        return out

    @property
    def placeholders(self) -> int:
        return sum(len(p) for p in self.nodes.values())

    def uses(self) -> list[int]:
        """How many graph nodes each collective stands at."""
        uses = [0] * len(self.table)
        for pairs in self.nodes.values():
            for _, i in pairs:
                uses[i] += 1
        return uses

    def summary(self) -> list[str]:
        """One line per distinct collective with how many graph nodes it stands at."""
        uses = self.uses()
        groups = len(self.comms) > 1 or self.comms[0].name != WORLD

        def on(calls: tuple[Call, ...]) -> str:
            g = self.comms[calls[0].comm]
            return f" on {g.name} ({g.nranks} ranks)" if groups else ""

        return [
            f"#{i}: " + " + ".join(c.describe() for c in calls) + f" ({uses[i]} nodes)" + on(calls)
            for i, calls in enumerate(self.table)
        ]
