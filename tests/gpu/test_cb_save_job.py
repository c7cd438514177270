"""The operator's SAVE Job of a transformers deployment on a GPU, end to end: the Job's container as
the operator writes it (`ember save --job -- <engine.args>`, its environment) SAVEs into a file://
store; the operator's store probe finds the manifest under the GraphArchive's identity hash; a
standalone sidecar fetches the archive by that hash, as a pod's sidecar does, and `ember serve`
with the same options and the engine container's environment LOADs it: restored, and with the
tokens of a native start."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.serving import clean_env, serve

from ember import contract, native
from ember.identity import COMPAT_ENV_VARS
from ember_operator.api import GraphArchiveSpec, ModelDeploymentSpec
from ember_operator.jobs import save_container
from ember_operator.planning import Context, archive_object, template_of
from ember_operator.pods import StoreAccess, engine_container
from ember_operator.store_probe import probe_store

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]  # a SAVE and two engine starts

ENGINE_ARGS = ["--layers", "2", "--num-blocks", "32"]  # `ember serve` options; the model is the identity's
SERVE = ["--model", "llama-3-8b", *ENGINE_ARGS]  # the serving pods' `ember serve`: the same model and sizing
PROMPT = [7, 99, 1234, 5, 42, 3000, 17, 8]


def _values(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    lib = native.find_library()
    if lib is None:
        pytest.skip("libember.so is not built (pip install -e .)")
    from ember.runtime.session import ember_argv

    work = tmp_path_factory.mktemp("cb-job")
    store = work / "store"
    ctx = Context(sidecar_image="ember:test", default_store=store.as_uri(), local_store_root=str(work))
    spec = ModelDeploymentSpec.model_validate({
        "model": {"name": "llama-3-8b"},
        "engine": {"kind": "transformers", "version": transformers.__version__, "image": "engine:test",
                   "args": ENGINE_ARGS},
        "gpu": {"product": "NVIDIA-H100-80GB-HBM3"},
    })
    ga = GraphArchiveSpec.model_validate(archive_object("ga", "default", spec, ctx)["spec"])
    container = save_container(ga, StoreAccess.of(ga.store))
    env = {**clean_env(), **_values(container)}
    env.update({"LD_PRELOAD": str(lib), contract.ENV_LIB: str(lib), contract.ENV_RUN_DIR: str(work / "run"),
                contract.ENV_TERMINATION_LOG: str(work / "termination-log")})
    cmd = ember_argv(*container["command"][1:], *container["args"])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    log = (work / "termination-log").read_text() if (work / "termination-log").exists() else ""
    assert proc.returncode == 0, (log, proc.stdout[-3000:], proc.stderr[-3000:])
    engine_env = _values(engine_container(template_of("default", spec, ctx)))
    return {"store": store, "identity": ga.identity_hash, "summary": json.loads(log), "job_env": env,
            "serve_env": {**clean_env(), **{k: v for k, v in engine_env.items() if k in COMPAT_ENV_VARS}}}


def test_the_job_publishes_under_the_graph_archive_identity(job: dict[str, Any]) -> None:
    summary, identity, store = job["summary"], job["identity"], job["store"]
    assert summary["published"] and summary["identity"] == identity and summary["graphs"] > 0
    probe = probe_store(store.as_uri(), identity, {}, 10.0)  # what the operator checks before Available
    assert probe.manifest is not None and not probe.invalid, probe
    assert probe.manifest.digest == summary["manifest_digest"] and probe.manifest.graphs == summary["graphs"]


def test_the_pods_sidecar_fetches_it_and_serve_restores_the_native_tokens(
    job: dict[str, Any], tmp_path: Path
) -> None:
    env = job["serve_env"]
    assert {k: env.get(k) for k in COMPAT_ENV_VARS} == {k: job["job_env"].get(k) for k in COMPAT_ENV_VARS}
    health, tokens, logs = serve(SERVE, tmp_path / "run", PROMPT, store=job["store"],
                                 identity=job["identity"], env=env)
    assert health["mode"] == "restored", (health, logs)
    assert health["graphs"] > 0 and "load" in health["stages"]
    native_health, native_tokens, logs = serve(SERVE, tmp_path / "native", PROMPT, env=env)
    assert native_health["mode"] == "native", (native_health, logs)
    assert tokens == native_tokens
