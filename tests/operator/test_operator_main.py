"""`ember-operator --help` prints the settings and exits 0 without touching a cluster (the image
smoke-run in CI, images/smoke.sh, runs it); unknown flags exit 2."""

from __future__ import annotations

import pytest

from ember_operator.main import main


def test_help_lists_the_settings_and_starts_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "EMBER_OPERATOR_SIDECAR_IMAGE" in capsys.readouterr().out


def test_unknown_flags_are_refused() -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--bogus"])
    assert exited.value.code == 2
