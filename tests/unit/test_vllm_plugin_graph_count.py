"""CPU: the vLLM plugin reports the graphs vLLM counts as captured once start-up is over, and every
capture while serving (`cudagraphs` stage), from vLLM's `compilation_counter` (a stand-in here)."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import pytest

from ember.engines.vllm import plugin
from ember.engines.vllm import report as reports


@dataclasses.dataclass
class CompilationCounter:  # vllm/compilation/counter.py's shape
    num_cudagraph_captured: int = 0
    num_inductor_compiles: int = 0


def test_captures_after_start_up_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = CompilationCounter(num_cudagraph_captured=3)
    module = types.ModuleType("vllm.compilation.counter")
    module.compilation_counter = counter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.compilation.counter", module)
    monkeypatch.setattr(plugin, "STATE", plugin._State())
    path = tmp_path / "vllm-report.json"
    monkeypatch.setenv("EMBER_VLLM_REPORT", str(path))

    plugin.watch_graph_captures()
    assert reports.read(path)["stages"]["cudagraphs"]["at_start"] == 3
    assert reports.read(path)["stages"]["cudagraphs"]["serving"] == 0
    counter.num_inductor_compiles = 5  # another counter: no report
    counter.num_cudagraph_captured += 1
    counter.num_cudagraph_captured += 1
    assert reports.read(path)["stages"]["cudagraphs"] | {"t": 0} == {"t": 0, "at_start": 3, "serving": 2}

    plugin.watch_graph_captures()  # a second start-up counts from its own start, patched once
    counter.num_cudagraph_captured += 1
    assert reports.read(path)["stages"]["cudagraphs"]["serving"] == 1
    assert CompilationCounter(num_cudagraph_captured=9).num_cudagraph_captured == 9


def test_no_vllm_no_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm.compilation.counter", None)  # import fails
    monkeypatch.setattr(plugin, "STATE", plugin._State())
    monkeypatch.setenv("EMBER_VLLM_REPORT", str(tmp_path / "r.json"))
    plugin.watch_graph_captures()
    assert not (tmp_path / "r.json").exists()
