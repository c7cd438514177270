"""Where vLLM 0.26 keeps its CUDA graphs, read at SAVE and filled at LOAD (GPU side).

Three sites hold graphs (`ember.engines.vllm.keys` names them in every archive key):

- PIECEWISE: one `CUDAGraphWrapper` per compiled submodule (`compilation/backends.py`
  `wrap_with_cudagraph_if_needed`; its runnable is a `PiecewiseBackend` with
  `piecewise_compile_index`), entries `concrete_cudagraph_entries[BatchDescriptor] =
  CUDAGraphEntry(cudagraph, output weak refs, input_addresses)`; V1 and V2 runners alike;
- V1 FULL: one `CUDAGraphWrapper(model, runtime_mode=FULL)` (`gpu_model_runner.py` `load_model`);
- V2 FULL: `ModelCudaGraphManager.graphs[BatchExecutionDescriptor] = CUDAGraph`, the model's
  output copied inside the graph into the manager's persistent `hidden_states`.

SAVE keeps every graph (`keep_graph=True`) and records what each writes (its outputs: the proof
compares them, LOAD rebuilds them as tensors over the same addresses) and reads (weak views of its
tensor arguments: the proof restores them before each replay). LOAD puts `RestoredGraph` objects
where the engine looks, so its dispatcher finds every key and never captures.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ember.engines.vllm.keys import (
    PIECEWISE_ENTRY,
    V1_FULL_ENTRY,
    V2_FULL_GRAPH,
    GraphKey,
    desc_of,
)

if TYPE_CHECKING:  # torch only where graphs are read or made: the module's LOAD-side helpers are CPU-tested
    import torch

log = logging.getLogger("ember.vllm")


class SiteError(RuntimeError):
    """The engine's graph sites are not laid out as the adapter expects."""


# ---- outputs as data ------------------------------------------------------------------------


def describe(value: Any) -> Any:
    """A wrapper entry's output as JSON: tensors as (address, shape, stride, dtype), nesting kept."""
    import torch

    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return {
            "ptr": value.data_ptr(),
            "shape": list(value.shape),
            "stride": list(value.stride()),
            "dtype": str(value.dtype).removeprefix("torch."),
        }
    if isinstance(value, list | tuple):
        return {"seq": "list" if isinstance(value, list) else "tuple", "items": [describe(v) for v in value]}
    raise SiteError(f"graph output of type {type(value).__name__} is not handled")


def rebuild(spec: Any) -> Any:
    """The output again, as tensors over SAVE's addresses (memory libember replayed at LOAD)."""
    from ember.engines.decode.model import tensor_at

    if spec is None:
        return None
    if "ptr" in spec:
        return tensor_at(int(spec["ptr"]), tuple(spec["shape"]), tuple(spec["stride"]), spec["dtype"])
    items = [rebuild(s) for s in spec["items"]]
    return items if spec["seq"] == "list" else tuple(items)


def flat_tensors(value: Any) -> list[torch.Tensor]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in flat_tensors(v)]
    return []


# ---- the sites -------------------------------------------------------------------------------


def wrapper_class() -> Any:
    """vLLM's `CUDAGraphWrapper` (every PIECEWISE piece runs through its `__call__`, with graphs or
    without)."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    return CUDAGraphWrapper


def wrappers() -> dict[tuple[int, int], Any]:
    """Every CUDAGraphWrapper of this process by (site, piece)."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode

    out: dict[tuple[int, int], Any] = {}
    for w in list(CUDAGraphWrapper._all_instances):
        if w.runtime_mode == CUDAGraphMode.PIECEWISE:
            piece = getattr(w.runnable, "piecewise_compile_index", None)
            if piece is None:
                raise SiteError(f"a PIECEWISE wrapper around {type(w.runnable).__name__} has no piece index")
            where = (PIECEWISE_ENTRY, int(piece))
        else:
            where = (V1_FULL_ENTRY, 0)
        if where in out:
            raise SiteError(f"two graph wrappers at {where} (a second model or drafter?)")
        out[where] = w
    return out


def piece_count() -> int:
    return sum(1 for site, _ in wrappers() if site == PIECEWISE_ENTRY)


def batch_descriptor(key: GraphKey) -> Any:
    from vllm.forward_context import BatchDescriptor

    d = desc_of(key)
    return BatchDescriptor(num_tokens=d.num_tokens, num_reqs=d.num_reqs, uniform=bool(d.uniform))


def execution_descriptor(key: GraphKey) -> Any:
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    d = desc_of(key)
    return BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.FULL,
        num_tokens=d.num_tokens,
        num_reqs=d.num_reqs,
        uniform_token_count=d.uniform or None,
    )


def key_of_entry(site: int, piece: int, bd: Any) -> GraphKey:
    return (site, piece, int(bd.num_tokens), -1 if bd.num_reqs is None else int(bd.num_reqs), int(bd.uniform))


def key_of_execution(desc: Any) -> GraphKey:
    nr = -1 if desc.num_reqs is None else int(desc.num_reqs)
    return (V2_FULL_GRAPH, 0, int(desc.num_tokens), nr, int(desc.uniform_token_count or 0))


# ---- SAVE: what the engine captured ----------------------------------------------------------


@dataclass
class Captured:
    """One captured graph: the kept CUDAGraph, what it writes and reads."""

    graph: Any
    output: Any  # the wrapper entry's output (weak refs), or the V2 hidden-state slice
    inputs: list[torch.Tensor] = field(default_factory=list)  # weak views of its tensor arguments
    input_addresses: list[int] = field(default_factory=list)


@contextlib.contextmanager
def recording_inputs() -> Iterator[dict[tuple[int, Any], list[torch.Tensor]]]:
    """While capturing: weak views of each wrapper capture's tensor arguments, by (id(wrapper),
    batch descriptor). The engine keeps only their addresses; the proof needs the tensors."""
    import torch
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.forward_context import get_forward_context, is_forward_context_available
    from vllm.utils.torch_utils import weak_ref_tensor

    seen: dict[tuple[int, Any], list[torch.Tensor]] = {}
    original = CUDAGraphWrapper.__call__

    def recording_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if is_forward_context_available():
            ctx = get_forward_context()
            bd = ctx.batch_descriptor
            if ctx.cudagraph_runtime_mode == self.runtime_mode and bd not in self.concrete_cudagraph_entries:
                seen[(id(self), bd)] = [weak_ref_tensor(a) for a in args if isinstance(a, torch.Tensor)]
        return original(self, *args, **kwargs)

    CUDAGraphWrapper.__call__ = recording_call  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        CUDAGraphWrapper.__call__ = original  # type: ignore[method-assign]


def captured_graphs(
    runner: Any, inputs: Mapping[tuple[int, Any], list[torch.Tensor]]
) -> dict[GraphKey, Captured]:
    """Every graph the engine holds now, by archive key."""
    out: dict[GraphKey, Captured] = {}
    for (site, piece), w in wrappers().items():
        for bd, entry in w.concrete_cudagraph_entries.items():
            if entry.cudagraph is None:
                continue
            out[key_of_entry(site, piece, bd)] = Captured(
                entry.cudagraph,
                entry.output,
                list(inputs.get((id(w), bd), [])),
                list(entry.input_addresses or []),
            )
    manager = getattr(runner, "cudagraph_manager", None)
    if manager is not None and getattr(manager, "graphs", None):
        hidden = manager.hidden_states
        for desc, graph in manager.graphs.items():
            out[key_of_execution(desc)] = Captured(
                MetadataFirst(graph, v2_full_metadata(runner, desc)),
                hidden[: desc.num_tokens] if hidden is not None else None,
            )
    return out


class MetadataFirst:
    """A V2 FULL graph whose bare replay (SAVE's RNG check and proof) first rebuilds its
    descriptor's attention metadata, as vLLM does before every launch of it. Without that it
    reads what the last build left in the attention builder's one scheduler-metadata buffer: the
    smallest size's (V2 captures the largest first), whose unwritten padding a larger size's
    FlashAttention-3 kernel would take for tile and split counts: a 2-layer Llama SAVE replayed its
    graphs for ~3 s each and one FULL graph was not bit-stable; with the rebuild its proof took
    0.21 s, every graph bitwise (h200x2-20261129e). Everything else is the graph's own. A rebuild
    that fails is said once; the replays are bare from then."""

    def __init__(self, graph: Any, prepare: Any) -> None:
        self.graph, self.prepare = graph, prepare

    def replay(self) -> None:
        if self.prepare is not None:
            try:
                self.prepare()
            except Exception as exc:
                log.warning("ember: the V2 FULL graph's metadata could not be rebuilt before a bare "
                            "replay (%s: %s); replaying on what is there", type(exc).__name__, exc)
                self.prepare = None
        self.graph.replay()

    def __getattr__(self, name: str) -> Any:  # raw_cuda_graph() and the rest: the graph's own
        return getattr(self.graph, name)


def v2_full_metadata(runner: Any, desc: Any) -> Any:
    """What V2's capture ran before capturing `desc` (`prepare_inputs_to_capture`): dummy inputs,
    slot mappings and the attention metadata of its size, written where the graph reads them."""

    def prepare() -> None:
        from vllm.v1.worker.gpu.cudagraph_utils import prepare_inputs_to_capture

        tokens = int(desc.num_tokens)
        reqs = int(desc.num_reqs or min(tokens, runner.cudagraph_manager.max_num_reqs))
        prepare_inputs_to_capture(reqs, tokens, runner.model_state, runner.input_buffers, runner.block_tables,
                                  runner.attn_groups, runner.kv_cache_config)

    return prepare


# ---- LOAD: restored graphs where the engine looks --------------------------------------------


def install(
    runner: Any, restored: Mapping[GraphKey, Any], outputs: Mapping[str, Any], extra: Mapping[str, Any]
) -> int:
    """Put `restored` (key → object with replay()) into the wrappers' entries and the V2 manager.
    `outputs`: each key's output spec (SAVE's `describe`), by "k1,k2,..."; `extra`: the V2
    manager's persistent buffers. Everything is checked before anything is changed."""
    from vllm.compilation.cuda_graph import CUDAGraphEntry

    sites = wrappers()
    manager = getattr(runner, "cudagraph_manager", None)
    plan: list[tuple[Any, Any, Any]] = []
    for key, graph in restored.items():
        spec = outputs.get(",".join(map(str, key)))
        if key[0] == V2_FULL_GRAPH:
            if manager is None:
                raise SiteError(f"graph {key} is for the V2 runner's manager; this runner has none")
            plan.append((manager.graphs, execution_descriptor(key), graph))
            continue
        w = sites.get((key[0], key[1]))
        if w is None:
            raise SiteError(f"no graph wrapper at {(key[0], key[1])} for graph {key}")
        bd = batch_descriptor(key)
        entry = CUDAGraphEntry(batch_descriptor=bd, cudagraph=graph, output=rebuild(spec))
        entry.input_addresses = (
            list((extra.get("input_addresses") or {}).get(",".join(map(str, key)), [])) or None
        )
        plan.append((w.concrete_cudagraph_entries, bd, entry))
    for table, k, v in plan:
        table[k] = v
    if manager is not None:
        if extra.get("v2_hidden_states") is not None:
            manager.hidden_states = rebuild(extra["v2_hidden_states"])
        manager._graphs_captured = True  # the V2 dispatcher replays only after a capture
    return len(plan)


def replace(runner: Any, graphs: Mapping[GraphKey, Any]) -> dict[GraphKey, Any]:
    """Put `graphs` (key → object with replay()) where the engine finds installed graphs of those
    keys; returns what was there (LOAD's canary routes a step's launches this way for a while)."""
    sites = wrappers()
    manager: Any = getattr(runner, "cudagraph_manager", None)
    before: dict[GraphKey, Any] = {}
    for key, graph in graphs.items():
        if key[0] == V2_FULL_GRAPH:
            desc = execution_descriptor(key)
            before[key], manager.graphs[desc] = manager.graphs[desc], graph
            continue
        entry = sites[(key[0], key[1])].concrete_cudagraph_entries[batch_descriptor(key)]
        before[key], entry.cudagraph = entry.cudagraph, graph
    return before


def engine_state(runner: Any) -> dict[str, Any]:
    """What `install` changes in the V2 manager, as it is before (`uninstall` puts it back)."""
    manager = getattr(runner, "cudagraph_manager", None)
    if manager is None:
        return {}
    return {"hidden_states": getattr(manager, "hidden_states", None),
            "captured": bool(getattr(manager, "_graphs_captured", False))}


def uninstall(runner: Any, state: Mapping[str, Any]) -> None:
    """Every installed graph gone and the V2 manager as `engine_state` found it: a LOAD refused
    after `install` (its canary) lets vLLM capture natively, not replay the refused graphs."""
    for w in wrappers().values():
        w.concrete_cudagraph_entries.clear()
    manager = getattr(runner, "cudagraph_manager", None)
    if manager is not None and state:
        manager.graphs.clear()
        manager.hidden_states = state.get("hidden_states")
        manager._graphs_captured = bool(state.get("captured"))
