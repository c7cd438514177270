"""`RestoredGraph`: the small object engines hold for a restored graph: `replay(stream=None)` and
`reset()`, like torch.cuda.CUDAGraph (transformers' continuous batching registry calls exactly
these two). It launches through its GraphLibrary (templates.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.runtime.graphs.templates import GraphLibrary


class RestoredGraph:
    """A graph of the library under its engine key. Same surface as torch.cuda.CUDAGraph's replay/reset."""

    def __init__(self, library: GraphLibrary, index: int) -> None:
        self._library = library
        self.index = index
        self.key = library.keys[index]

    def replay(self, stream: Any = None) -> None:
        self._library.launch(self.index, stream)

    def reset(self) -> None:
        """Drop this key's dedicated exec, if any (the template stays, it serves the group)."""
        self._library.own.drop(self.index)

    def __repr__(self) -> str:
        return f"RestoredGraph(key={self.key})"
