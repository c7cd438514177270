"""CPU: on N ranks, every vLLM worker's archive opening is agreed before any rank sizes its KV
cache (`plugin._open_agreed`): a rank refused alone would profile vLLM's graph memory with real
collectives its restoring peers never join (vLLM 0.26 V1 `profile_cudagraph_memory`)."""

from __future__ import annotations

from typing import Any

import pytest

from ember.engines.vllm import plugin
from ember.engines.vllm.adapter import PEER_REFUSED
from ember.runtime.adapter import LOAD, Refused


class _Restore:
    abandoned = False

    def abandon(self) -> None:
        self.abandoned = True


class _Adapter:
    """A worker's adapter whose vote answers as its peers would (MIN of every rank's)."""

    def __init__(self, peers_ok: bool) -> None:
        self.peers_ok, self.cast = peers_ok, []

    def vote(self, ok: bool) -> bool:
        self.cast.append(ok)
        return ok and self.peers_ok


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Any:
    monkeypatch.setattr(plugin, "STATE", plugin._State())
    monkeypatch.setenv("EMBER_VLLM_REPORT", str(tmp_path / "vllm-report.json"))
    return plugin.STATE


def test_every_rank_that_opened_keeps_the_archive_when_all_did(state: Any, monkeypatch) -> None:
    restore = _Restore()
    monkeypatch.setattr(plugin, "_open", lambda adapter: restore)
    adapter = _Adapter(peers_ok=True)
    assert plugin._open_agreed(adapter) is restore
    assert adapter.cast == [True] and not state.refusal and not restore.abandoned


def test_a_rank_that_opened_drops_the_archive_when_a_peer_could_not(state: Any, monkeypatch) -> None:
    restore = _Restore()
    monkeypatch.setattr(plugin, "_open", lambda adapter: restore)
    adapter = _Adapter(peers_ok=False)
    assert plugin._open_agreed(adapter) is None
    assert restore.abandoned and state.refusal == f"{LOAD}: {PEER_REFUSED}"  # then no archive KV size


@pytest.mark.parametrize("error,why", [(Refused("compat", "vLLM's compile cache is not on this node"),
                                        "compat: vLLM's compile cache is not on this node"),
                                       (OSError("disk full"), f"{LOAD}: OSError: disk full")])
def test_a_rank_that_could_not_open_still_casts_its_vote(state: Any, monkeypatch, error: Exception,
                                                         why: str) -> None:
    def refuse(adapter: Any) -> Any:
        raise error

    monkeypatch.setattr(plugin, "_open", refuse)
    adapter = _Adapter(peers_ok=True)
    assert plugin._open_agreed(adapter) is None
    assert adapter.cast == [False] and state.refusal == why
