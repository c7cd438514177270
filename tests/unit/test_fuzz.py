"""The parsers' fuzz targets (`ember bench fuzz`, benchmarks/ember_bench/fuzz.py): every input a
fuzz run found (tests/fuzz_corpus/regressions/<target>/) now meets a documented error, and a short
coverage-guided run of each target from the committed seed corpus finds nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.archive.graph_table import FormatError, decode
from ember_bench import fuzz

CORPUS = Path(__file__).resolve().parents[1] / "fuzz_corpus"
REGRESSIONS = sorted((CORPUS / "regressions").glob("*/*"))


@pytest.mark.parametrize("path", REGRESSIONS, ids=[f"{p.parent.name}/{p.name}" for p in REGRESSIONS])
def test_found_inputs_meet_a_documented_error(path: Path) -> None:
    target = fuzz.TARGET_FUNCTIONS[path.parent.name]()
    target(path.read_bytes())  # raises (or faults) on anything but the parser's own errors


def test_a_table_naming_an_impossible_index_size_is_refused_before_allocating() -> None:
    blob = (CORPUS / "regressions" / "graph_table" / "index-raw-size-8gib.bin").read_bytes()
    with pytest.raises(FormatError, match="the frame holds 4048 bytes, the header says 8589934592"):
        decode(blob)


@pytest.mark.parametrize("target", fuzz.TARGETS)
def test_a_short_fuzz_run_finds_nothing(target: str, tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    result = fuzz.run_target(target, runs=3000, out=tmp_path, seed=1)
    assert result["exit"] == 0 and not result["findings"], result["error_tail"]
    assert result["executions"] >= 3000 and result["coverage_edges"] > 0
