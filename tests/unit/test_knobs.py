"""The EMBER_* knobs: one registry (ember.settings), read nowhere else, listed by `ember doctor`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ember import settings
from ember.cli import doctor_report

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_parsing_and_what_doctor_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in settings.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert settings.on("EMBER_DEDICATE") and not settings.on("EMBER_UPLOAD_BEHIND")
    assert settings.number("EMBER_EXEC_MEMORY_MB") == 2048
    monkeypatch.setenv("EMBER_DEDICATE", "0")
    monkeypatch.setenv("EMBER_UPLOAD_BEHIND", "yes")
    monkeypatch.setenv("EMBER_EXEC_MEMORY_MB", "lots")  # does not parse: the default
    monkeypatch.setenv("EMBER_NATIVE_READ", "perhaps")  # neither: the default
    assert not settings.on("EMBER_DEDICATE") and settings.on("EMBER_UPLOAD_BEHIND")
    assert settings.number("EMBER_EXEC_MEMORY_MB") == 2048 and settings.on("EMBER_NATIVE_READ")
    assert set(settings.changed()) == {"EMBER_DEDICATE", "EMBER_UPLOAD_BEHIND", "EMBER_EXEC_MEMORY_MB",
                                       "EMBER_NATIVE_READ"}
    assert "EMBER_DEDICATE=0" in doctor_report()["settings changed"]


def test_no_module_reads_a_knob_around_the_registry() -> None:
    read = re.compile(r"""(?:environ\.get|environ\[|getenv)\(?\s*["'](EMBER_[A-Z_]+)""")
    around = []
    for path in [*(ROOT / "ember").rglob("*.py"), *(ROOT / "sidecar").rglob("*.py")]:
        if path.name == "settings.py":
            continue
        for name in read.findall(path.read_text()):
            if name in settings.SETTINGS:
                around.append(f"{path.relative_to(ROOT)}: {name}")
    assert not around, around
