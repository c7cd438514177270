"""e2e/test.sh: pytest's exit 5 (nothing collected) is success only for an explicit -k/-m filter
run outside CI; the full suite, or a CI run, that collects nothing fails."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.k8s  # e2e/test.sh starts (or finds) the local control plane first


def _test_sh(*args: str, ci: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    if ci:
        env["CI"] = "true"
    return subprocess.run(["bash", "e2e/test.sh", *args, "-p", "no:cacheprovider", "-q"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300).returncode


def test_a_filter_that_matches_nothing_passes_only_outside_ci() -> None:
    filtered = ("tests/unit/test_gpu_gate.py", "-k", "no_such_test_anywhere")
    assert _test_sh(*filtered, ci=False) == 0
    assert _test_sh(*filtered, ci=True) == 5


def test_nothing_collected_without_a_filter_fails(tmp_path: Path) -> None:
    (tmp_path / "empty.py").write_text("")
    assert _test_sh(str(tmp_path), ci=False) == 5
