"""The operator's SAVE Job of a transformers deployment, run as its container runs it: the command,
arguments and environment the operator writes reach `ember save --job`, which saves the model and
sizing of the engine arguments under the identity hash the GraphArchive is named by (the hash its
pods' sidecar fetches): the model and sizing its serving pods' `ember serve` builds from the same
arguments. The engine is faked past the arguments (tests/gpu/test_cb_save_job.py runs it)."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
from operator_helpers import CTX, md_spec
from typer.testing import CliRunner

from ember import contract
from ember.cli import app, save_job
from ember.engines.transformers_cb import hooks
from ember.identity import COMPAT_ENV_VARS, ArchiveIdentity
from ember.runtime import session
from ember.serving import server
from ember.serving.options import serve_options
from ember_operator import naming
from ember_operator.api import GraphArchiveSpec
from ember_operator.jobs import save_job as save_job_object
from ember_operator.planning import archive_object, claim_for, template_of
from ember_operator.pods import StoreAccess, pod_spec, serving_pod


def _save_container(spec: Any) -> tuple[GraphArchiveSpec, dict[str, Any]]:
    ga = GraphArchiveSpec.model_validate(archive_object("ga-x", "default", spec, CTX)["spec"])
    job = save_job_object(name="job", namespace="default", archive_name=naming.archive_name(ga.identity_hash),
                          archive_uid="u", spec=ga, store=StoreAccess.of(ga.store),
                          sidecar_image="ember:test", timeout_seconds=600, attempt=0)
    return ga, job["spec"]["template"]["spec"]["containers"][0]


def test_the_operators_save_job_publishes_under_the_archive_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = md_spec(model={"name": "tiny-llama"}, store=None,  # the operator's: file:///var/lib/ember
                   engine={"kind": "transformers", "version": "5.17", "image": "engine:test",
                           "args": ["--layers", "2", "--num-blocks", "32"]})
    ga, container = _save_container(spec)
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env[contract.ENV_TERMINATION_LOG] = str(tmp_path / "termination-log")

    monkeypatch.setattr(hooks, "engine_version", lambda: "5.17.0")
    monkeypatch.setattr(session, "reexec_under_libember", lambda mode: None)
    monkeypatch.setattr(save_job, "_need_gpu", lambda: None)
    saved: list[tuple[server.ServeOptions, str, ArchiveIdentity]] = []

    def save(o: server.ServeOptions, store: str, identity: ArchiveIdentity) -> Any:
        saved.append((o, store, identity))
        return types.SimpleNamespace(published=True, summary=lambda: {"identity": identity.hash()})

    monkeypatch.setattr(server, "save", save)
    assert container["command"][0] == "ember"
    result = CliRunner().invoke(app, [*container["command"][1:], *container["args"]], env=env)

    assert result.exit_code == 0, (tmp_path / "termination-log").read_text()
    options, store, identity = saved[0]
    assert identity.hash() == ga.identity_hash == spec.identity().hash()  # the claim's identity too
    assert store == "file:///var/lib/ember"
    assert (options.model, options.layers, options.num_blocks) == ("tiny-llama", 2, 32)
    assert json.loads((tmp_path / "termination-log").read_text())["identity"] == ga.identity_hash

    # The serving pods' `ember serve` (their command, from the same engine.args) builds the model
    # and the sizing the Job saved, and takes the deployment's claims.
    engine = serving_pod(template_of("default", spec, CTX), claim_for("tiny", spec, None, "NoArchive"), "p",
                         "u")["spec"]["containers"][0]
    assert engine["command"][:2] == ["ember", "serve"]
    served, unknown = serve_options(engine["command"][2:])
    assert unknown == [] and (served.host, served.port) == ("0.0.0.0", 8000)
    assert served.run_dir == Path(contract.RUN_DIR) and served.use_handoff
    assert server.model_build(served) == server.model_build(options)
    assert server.engine_sizing(served) == server.engine_sizing(options)
    assert server.claim_problem(served, claim_for("tiny", spec, None, "NoArchive").engine_args) == ""


def test_the_save_job_and_the_engine_set_the_environment_load_compares() -> None:
    """LOAD refuses an archive whose compatibility key's environment (COMPAT_ENV_VARS) is not the
    engine's: the SAVE container and the serving pods' engine container set the same, a template's
    variables included."""
    spec = md_spec(template={"spec": {"containers": [{"name": "engine", "env": [
        {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:False"}]}]}})
    _, save = _save_container(spec)
    engine = pod_spec(template_of("default", spec, CTX))["containers"][0]

    def compat(container: dict[str, Any]) -> dict[str, str]:
        return {e["name"]: e.get("value", "") for e in container["env"] if e["name"] in COMPAT_ENV_VARS}

    assert compat(save) == compat(engine) == {"NCCL_CUMEM_ENABLE": "0",
                                              "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
