"""Is there a GPU, and must there be one (EMBER_REQUIRE_GPU=1)? Used by tests/conftest.py's GPU
gate and its test (a module of its own: every tier has a conftest.py, so `conftest` is ambiguous)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

REQUIRE_GPU_ENV = "EMBER_REQUIRE_GPU"


@functools.cache
def gpu_available() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def gpu_required() -> bool:
    return os.environ.get(REQUIRE_GPU_ENV, "").strip() not in ("", "0")
