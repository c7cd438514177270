"""The GPU tier cannot go green while testing nothing: with EMBER_REQUIRE_GPU=1 every skip of a
GPU test (no GPU, no libember, no torch at import) fails the run (tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.gpu_gate import REQUIRE_GPU_ENV, gpu_available

ROOT = Path(__file__).resolve().parents[2]


def _run_gpu_tier(require: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_GPU_ENV}
    if require:
        env[REQUIRE_GPU_ENV] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider",
         "--continue-on-collection-errors"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU: the GPU tier runs for real there")
def test_gpu_skips_fail_only_when_a_gpu_is_required() -> None:
    relaxed = _run_gpu_tier(require=False)
    assert relaxed.returncode == 0, relaxed.stdout[-2000:]
    assert "skipped" in relaxed.stdout and "failed" not in relaxed.stdout

    strict = _run_gpu_tier(require=True)
    assert strict.returncode == 1, strict.stdout[-2000:]
    out = strict.stdout
    assert f"{REQUIRE_GPU_ENV}=1 and a GPU test was skipped" in out
    if importlib.util.find_spec("torch") is None:  # CI's machine: no torch
        assert "could not import 'torch'" in out  # module-level importorskip: a collection error
    assert "no NVIDIA GPU" in out  # the tier's own skip marker
    assert " passed" not in out and " skipped" not in out.splitlines()[-1]
