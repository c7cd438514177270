"""Locating and loading libember, the native interposer (built from native/).

The library is LD_PRELOADed into engine processes; Python reaches its control API with ctypes.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

LIB_NAME = "libember.so"
_HERE = Path(__file__).resolve().parent


def candidate_paths() -> list[Path]:
    """Where the library may be, most specific first."""
    paths: list[Path] = []
    if env := os.environ.get("EMBER_LIB"):
        paths.append(Path(env))
    paths.append(_HERE / "lib" / LIB_NAME)  # inside an installed wheel
    # Editable installs put built files under site-packages/ember/lib.
    paths += [Path(p) / "ember" / "lib" / LIB_NAME for p in sys.path if p]
    root = _HERE.parent
    paths += sorted(root.glob(f"build/*/{LIB_NAME}")) + [root / "native" / "build" / LIB_NAME]
    return paths


def find_library() -> Path | None:
    return next((p for p in candidate_paths() if p.is_file()), None)


def load_library(path: Path | None = None) -> ctypes.CDLL:
    """dlopen the library (a no-op if it is already LD_PRELOADed: same handle)."""
    path = path or find_library()
    if path is None:
        raise FileNotFoundError(
            f"{LIB_NAME} not found; build it with `pip install -e .` or set EMBER_LIB. "
            f"Looked in: {', '.join(str(p) for p in candidate_paths()[:4])}"
        )
    return ctypes.CDLL(str(path))
