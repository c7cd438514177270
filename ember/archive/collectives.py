"""The archive's collective table (manifest engine facts, key "collectives"): where a graph
saved on one GPU for a world of several ranks holds collective placeholders, and what each one
is. Written by SAVE (`ember.runtime.comm.placeholders`), spliced by every rank's LOAD
(`ember.runtime.comm.Splicer`), shown by `ember inspect`. Nothing in it is per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
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

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Call:
        """From one of libember_nccl's call records (`ember_nccl_calls`)."""
        return cls(rec["op"], int(rec["send"]), int(rec["recv"]), int(rec["count"]), int(rec["dtype"]),
                   int(rec["redop"]), int(rec["root"]))

    def describe(self) -> str:
        red = f" {REDOPS.get(self.redop, self.redop)}" if self.redop >= 0 else ""
        root = f" root/peer={self.root}" if self.root >= 0 else ""
        return f"{self.op}{red} {self.count} x {DTYPES.get(self.dtype, self.dtype)}{root}"


@dataclass
class Collectives:
    """The archive's collective table: `table[i]` is one placeholder (several calls when they were
    grouped), `nodes[g]` the (node index, table index) pairs of graph g (in the table's order)."""

    world: int
    nccl_version: str
    table: list[tuple[Call, ...]]
    nodes: dict[int, list[tuple[int, int]]]

    def to_facts(self) -> dict[str, Any]:
        return {
            "world": self.world,
            "nccl_version": self.nccl_version,
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
        )

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
        return [
            f"#{i}: " + " + ".join(c.describe() for c in calls) + f" ({uses[i]} nodes)"
            for i, calls in enumerate(self.table)
        ]
