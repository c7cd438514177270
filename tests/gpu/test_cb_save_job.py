"""The SAVE Job of a transformers deployment on a GPU, end to end: `ember save --job --
<engine.args>` with the environment the operator gives its container SAVEs into a file:// store
under the identity's hash; a standalone sidecar fetches the archive by that hash, as a pod's
sidecar does, and `ember serve` with the same options LOADs it: restored, with the tokens of a
native start. tests/operator/test_operator_save_cb.py checks that environment and those arguments
against the operator's own builders (the operator's packages are not needed here)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.serving import clean_env, serve

from ember import contract, native
from ember.archive.manifest import loads
from ember.identity import ArchiveIdentity, canonical_json
from ember.identity_args import graph_args

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]  # a SAVE and two engine starts

ENGINE_ARGS = ["--layers", "2", "--num-blocks", "32"]  # `ember serve` options; the model is the identity's
SERVE = ["--model", "llama-3-8b", *ENGINE_ARGS]  # the serving pods' `ember serve`: the same model and sizing
PROMPT = [7, 99, 1234, 5, 42, 3000, 17, 8]
# What the operator sets of ember.identity.COMPAT_ENV_VARS, on the SAVE and the engine container alike.
COMPAT_ENV = {"NCCL_CUMEM_ENABLE": "0"}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    lib = native.find_library()
    if lib is None:
        pytest.skip("libember.so is not built (pip install -e .)")
    from ember.runtime.session import ember_argv

    work = tmp_path_factory.mktemp("cb-job")
    store, log = work / "store", work / "termination-log"
    # As the operator names a transformers deployment's archive (ModelDeploymentSpec.identity)
    identity = ArchiveIdentity(model="llama-3-8b", engine="transformers",
                               engine_version=transformers.__version__, capture_sizes=(1, 2, 4, 8),
                               gpu_product="NVIDIA-H100-80GB-HBM3", engine_args=graph_args(ENGINE_ARGS))
    env = {**clean_env(), **COMPAT_ENV, "LD_PRELOAD": str(lib), contract.ENV_LIB: str(lib),
           contract.ENV_IDENTITY: canonical_json(identity.canonical()).decode(),
           contract.ENV_IDENTITY_HASH: identity.hash(), contract.ENV_STORE: store.as_uri(),
           contract.ENV_TERMINATION_LOG: str(log)}
    proc = subprocess.run(ember_argv("save", "--job", "--", *ENGINE_ARGS), env=env, capture_output=True,
                          text=True, timeout=600)
    reason = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, (reason, proc.stdout[-3000:], proc.stderr[-3000:])
    return {"store": store, "identity": identity.hash(), "summary": json.loads(reason)}


def test_the_job_publishes_under_the_identity_hash(job: dict[str, Any]) -> None:
    summary, identity = job["summary"], job["identity"]
    assert summary["published"] and summary["identity"] == identity and summary["graphs"] > 0
    data = (job["store"] / "archives" / identity / "manifest").read_bytes()
    manifest = loads(data)
    # what the operator's store probe and the pods' sidecar check before anything else
    assert manifest.identity_hash == manifest.identity.hash() == identity
    assert hashlib.sha256(data).hexdigest() == summary["manifest_digest"]
    assert manifest.graphs.count == summary["graphs"]


def test_the_pods_sidecar_fetches_it_and_serve_restores_the_native_tokens(
    job: dict[str, Any], tmp_path: Path
) -> None:
    env = {**clean_env(), **COMPAT_ENV}  # the engine container's
    health, tokens, logs = serve(SERVE, tmp_path / "run", PROMPT, store=job["store"],
                                 identity=job["identity"], env=env)
    assert health["mode"] == "restored", (health, logs)
    assert health["graphs"] > 0 and "load" in health["stages"]
    native_health, native_tokens, logs = serve(SERVE, tmp_path / "native", PROMPT, env=env)
    assert native_health["mode"] == "native", (native_health, logs)
    assert tokens == native_tokens
