"""In-memory model of a captured CUDA graph, independent of CUDA.

SAVE (`ember.runtime.graphs.walk`) fills these records from live graphs; the archive format
(`ember.archive.graph_table`) encodes and decodes them; LOAD (`ember.runtime.graphs.rebuild`) turns them
back into CUDA graphs. Nothing here imports CUDA, so archives can be inspected anywhere.
Device pointers inside records are plain integers: the fixed-base layout makes them valid
again at LOAD.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class NodeType(IntEnum):
    """Values of CUgraphNodeType (cuda.h)."""

    KERNEL = 0
    MEMCPY = 1
    MEMSET = 2
    HOST = 3
    GRAPH = 4
    EMPTY = 5
    WAIT_EVENT = 6
    EVENT_RECORD = 7
    EXT_SEMAS_SIGNAL = 8
    EXT_SEMAS_WAIT = 9
    MEM_ALLOC = 10
    MEM_FREE = 11
    BATCH_MEM_OP = 12
    CONDITIONAL = 13


@dataclass(frozen=True)
class KernelRef:
    """A kernel found again at LOAD by the content hash of its image and its mangled name."""

    image: str  # hex content hash of the kernel image (a blob in the archive)
    name: str


@dataclass
class KernelParams:
    kernel: int  # index into GraphSet.kernels
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    # Exactly one of the two argument forms is set: `args` is the packed argument buffer
    # laid out by `arg_offsets`/`arg_sizes` (cuFuncGetParamInfo); `extra` is the opaque
    # CU_LAUNCH_PARAM_BUFFER_POINTER blob kept byte for byte.
    args: bytes = b""
    arg_offsets: tuple[int, ...] = ()
    arg_sizes: tuple[int, ...] = ()
    extra: bytes | None = None
    # Kernel node attributes (CUlaunchAttributeID → raw CUlaunchAttributeValue bytes).
    attrs: dict[int, bytes] = field(default_factory=dict)


@dataclass
class MemsetParams:
    dst: int
    pitch: int
    value: int
    element_size: int
    width: int
    height: int


@dataclass
class MemcpyParams:
    """A 1-D device-to-device copy (the only kind engines put in decode graphs)."""

    dst: int
    src: int
    size: int


@dataclass
class EventParams:
    event: int  # index of the event within its graph set; LOAD creates fresh events


@dataclass
class Node:
    type: NodeType
    params: KernelParams | MemsetParams | MemcpyParams | EventParams | Graph | None = None


@dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    # CUgraphEdgeData: from_port, to_port, type (0 default, 1 programmatic).
    from_port: int = 0
    to_port: int = 0
    type: int = 0


@dataclass
class Graph:
    """One captured graph, identified by the engine's key (batch size, or (q, kv) tuple)."""

    key: tuple[int, ...]
    nodes: list[Node]
    edges: list[Edge]


@dataclass
class FunctionAttrs:
    """Per-function state that lives outside graph nodes and must be re-applied at LOAD."""

    max_dynamic_shared: int = 0
    required_cluster: tuple[int, int, int] = (0, 0, 0)
    non_portable_cluster: int = 0
    carveout: int = -1


@dataclass
class GraphSet:
    """All graphs of one archive plus the tables they index into."""

    graphs: list[Graph]
    kernels: list[KernelRef]
    function_attrs: list[FunctionAttrs]
