"""SAVE's bare replays of V2 FULL graphs rebuild their size's attention metadata first
(`ember.engines.vllm.graphs.MetadataFirst`), as vLLM does before every launch."""

from __future__ import annotations

import logging

from ember.engines.vllm.graphs import MetadataFirst


class _Graph:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def replay(self) -> None:
        self.calls.append("replay")

    def raw_cuda_graph(self) -> int:
        return 0xC0FFEE


def test_every_replay_rebuilds_the_metadata_first_and_the_rest_is_the_graphs() -> None:
    calls: list[str] = []
    g = MetadataFirst(_Graph(calls), lambda: calls.append("prepare"))
    g.replay()
    g.replay()
    assert calls == ["prepare", "replay", "prepare", "replay"]
    assert g.raw_cuda_graph() == 0xC0FFEE  # what SAVE walks is the captured graph itself


def test_a_rebuild_that_fails_is_said_once_and_the_replays_go_on_bare(caplog) -> None:
    calls: list[str] = []

    def broken() -> None:
        calls.append("prepare")
        raise TypeError("prepare_inputs_to_capture() got an unexpected keyword")

    g = MetadataFirst(_Graph(calls), broken)
    with caplog.at_level(logging.WARNING, logger="ember.vllm"):
        g.replay()
        g.replay()
    assert calls == ["prepare", "replay", "replay"]
    assert caplog.text.count("could not be rebuilt") == 1 and "TypeError" in caplog.text
