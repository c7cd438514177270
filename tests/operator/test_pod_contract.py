"""The pod contract (ember/contract.py) holds across its three sides: what the operator writes on
pods and SAVE Jobs is what the sidecar and the engine side (ember.handoff) read."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
from operator_helpers import CTX, md_spec, observed

from ember import contract, handoff
from ember.contract import Claim, ClaimError, SaveResult
from ember_operator.api import GraphArchiveSpec, IdentitySpec, SaveSpec
from ember_operator.jobs import read_termination, save_job
from ember_operator.observed import ArchiveView, PodView
from ember_operator.planning import plan_deployment, template_of
from ember_operator.pods import StoreAccess, warm_pod
from ember_sidecar.claims import parse_claim, parse_prefetch
from ember_sidecar.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
HASH = md_spec().identity().hash()
URI = f"s3://ember/ember/archives/{HASH}/manifest"


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = pod["spec"]
    return {c["name"]: c for c in spec["initContainers"] + spec["containers"]}


def _env(container: dict[str, Any]) -> dict[str, str]:
    """A container's literal environment (downward-API entries left out)."""
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def _serving_plan(archive: ArchiveView) -> Any:
    return plan_deployment(observed(archive=archive), CTX)


def test_engine_and_sidecar_share_the_run_dir_the_engine_side_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    pod = warm_pod(template_of("default", md_spec(), CTX))
    containers = _containers(pod)
    engine, sidecar = containers[contract.ENGINE_CONTAINER], containers[contract.SIDECAR_CONTAINER]
    for c in (engine, sidecar):
        assert _env(c)[contract.ENV_RUN_DIR] == contract.RUN_DIR
        assert {"name": "ember-run", "mountPath": contract.RUN_DIR} in c["volumeMounts"]
    assert {"name": "ember-run", "emptyDir": {}} in pod["spec"]["volumes"]  # one volume, both mount it

    # The engine side (ember.handoff) under the engine container's environment ...
    for name in (contract.ENV_RUN_DIR, contract.ENV_STORE, contract.ENV_SIDECAR_PORT,
                 contract.ENV_S3_ENDPOINT):
        monkeypatch.delenv(name, raising=False)
    assert handoff.run_dir_from_env() == Path(contract.RUN_DIR)  # the default is the pod's dir too
    for name, value in _env(engine).items():
        monkeypatch.setenv(name, value)
    assert handoff.run_dir_from_env() == Path(contract.RUN_DIR)
    # ... and the sidecar under its own: same directory, the port its probes use, the pool's store.
    for name, value in _env(sidecar).items():
        monkeypatch.setenv(name, value)
    settings = Settings.from_env()
    assert settings.run_dir == Path(contract.RUN_DIR) == Settings().run_dir
    ports = {p["containerPort"] for p in sidecar["ports"]}
    assert ports == {settings.port} == {contract.SIDECAR_PORT}
    assert sidecar["readinessProbe"]["httpGet"] == {"path": contract.READYZ, "port": settings.port}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": contract.LIVEZ, "port": settings.port}
    assert settings.store == "s3://ember/ember" and settings.s3_endpoint == "http://127.0.0.1:19000"
    assert _env(engine)[contract.ENV_LIB] == contract.LIB_PATH == _env(engine)["LD_PRELOAD"]


def test_claim_the_operator_writes_is_the_claim_the_sidecar_parses() -> None:
    plan = _serving_plan(ArchiveView(name="ga-x", phase="Available", uri=URI, digest="d" * 64))
    claim = plan.claim
    assert claim is not None and claim.archive_uri == URI and claim.identity == HASH
    assert claim.claimed_at is not None and claim.identity_spec and claim.revision
    pod = plan.creates[0]
    meta = pod["metadata"]
    # The whole object round-trips through the pod's labels and annotations ...
    assert Claim.from_annotations(meta["annotations"], meta["labels"]) == claim
    # ... and the sidecar restores exactly that claim (it reads annotations only).
    restored = parse_claim(meta["annotations"])
    assert restored is not None
    assert restored.key == claim.key and restored.claimed_at == claim.claimed_at
    # A claim patch on a warm pod carries the same.
    patch = plan.claims[0][1] if plan.claims else None
    assert patch is None or Claim.from_annotations(**_meta(patch)) == claim


def _meta(patch: dict[str, Any]) -> dict[str, Any]:
    return {"annotations": patch["metadata"]["annotations"], "labels": patch["metadata"]["labels"]}


def test_claim_patch_round_trips() -> None:
    warm = PodView(name="w", labels={contract.LABEL_POOL: contract.POOL_WARM}, resource_version="7",
                   ready=True, phase="Running")
    available = ArchiveView(name="ga-x", phase="Available", uri=URI, digest="d" * 64)
    plan = plan_deployment(observed(archive=available, warm=[warm]), CTX)
    (name, patch), = plan.claims
    assert name == "w" and Claim.from_annotations(**_meta(patch)) == plan.claim


def test_native_claim_carries_the_reason_to_the_sidecar() -> None:
    plan = _serving_plan(ArchiveView(name="ga-x", phase="Failed", reason="SaveFailed", message="OOM"))
    assert plan.claim is not None and plan.claim.native and plan.claim.native_reason == "SaveFailed"
    meta = plan.creates[0]["metadata"]
    assert Claim.from_annotations(meta["annotations"], meta["labels"]) == plan.claim
    with pytest.raises(ClaimError, match="native capture chosen by the operator: SaveFailed"):
        parse_claim(meta["annotations"])


def test_claim_stamp_keeps_microseconds() -> None:
    stamp = 1700000000.123456
    text = contract.format_claimed_at(stamp)
    assert text == "2023-11-14T22:13:20.123456Z"
    assert contract.parse_claimed_at(text) == stamp


def test_multi_gpu_rank_layout_round_trips() -> None:
    claim = Claim(URI, HASH, rank=3, world=4, deployment="d", revision="r", manifest_digest="d" * 64)
    assert Claim.from_annotations(claim.annotations(), claim.labels()) == claim
    restored = parse_claim(claim.annotations())
    assert restored is not None and (restored.rank, restored.world) == (3, 4)


def test_warm_pod_prefetch_reaches_the_sidecar() -> None:
    other = f"file:///x/archives/{'cd' * 32}/manifest"
    pod = warm_pod(template_of("default", md_spec(), CTX), prefetch=[URI, other, URI])
    assert parse_prefetch(pod["metadata"]["annotations"]) == sorted([URI, other])


def test_restore_results_the_sidecar_writes_are_what_the_operator_counts() -> None:
    assert PodView(name="p", annotations={contract.ANN_RESTORE: contract.RESTORED}).restored
    fell = PodView(name="p", annotations={contract.ANN_RESTORE: contract.FALLBACK_PREFIX + "digest-mismatch"})
    assert fell.fell_back and not fell.restored


def _save_job() -> dict[str, Any]:
    ident = md_spec().identity()
    spec = GraphArchiveSpec(identity_hash=ident.hash(), identity=IdentitySpec.of(ident),
                            store=md_spec().store, save=SaveSpec(image="engine:test", args=[]))
    return save_job(name="j", namespace="default", archive_name="ga-x", archive_uid="u", spec=spec,
                    store=StoreAccess(uri="s3://ember/ember"), sidecar_image="ember:test",
                    timeout_seconds=60, attempt=0)


def _terminated(exit_code: int, message: str) -> dict[str, Any]:
    return {"status": {"containerStatuses": [{"name": contract.SAVE_CONTAINER, "state": {
        "terminated": {"exitCode": exit_code, "message": message}}}]}}


def test_save_job_env_and_termination_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _save_job()
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["name"] == contract.SAVE_CONTAINER
    env = _env(container)
    assert json.loads(env[contract.ENV_IDENTITY])["model"]
    assert env[contract.ENV_IDENTITY_HASH] == HASH and env[contract.ENV_STORE] == "s3://ember/ember"
    assert env[contract.ENV_RUN_DIR] == contract.RUN_DIR
    assert container["terminationMessagePath"] == contract.TERMINATION_LOG
    assert job["metadata"]["annotations"] == {contract.ANN_SAVE_ATTEMPT: "0"}

    # What the runtime writes (write_termination_log) is what the operator reads (read_termination).
    log = tmp_path / "termination-log"
    monkeypatch.setenv(contract.ENV_TERMINATION_LOG, str(log))
    summary = {"manifest_digest": "sha256:ab", "bytes": 123, "graphs": 4, "identity": HASH,
               "durations": {"capture": 1.5, "publish": 0.25}, "published": True}
    contract.write_termination_log(summary)
    result = read_termination(_terminated(0, log.read_text()))
    assert result == SaveResult(succeeded=True, message=log.read_text(), manifest_digest="sha256:ab",
                                bytes=123, graphs=4, durations={"capture": 1.5, "publish": 0.25})
    contract.write_termination_log("SAVE failed: RuntimeError: CUDA out of memory")
    failed = read_termination(_terminated(1, log.read_text()))
    assert failed is not None and not failed.succeeded
    assert failed.reason == "SAVE failed: RuntimeError: CUDA out of memory"


def test_an_oversized_summary_stays_readable(tmp_path: Path) -> None:
    log = tmp_path / "log"
    summary = {"manifest_digest": "sha256:ab", "bytes": 1, "graphs": 2, "durations": {"save": 1.0},
               "proof": {f"graph-{i}": "x" * 64 for i in range(200)}}
    contract.write_termination_log(summary, str(log))
    text = log.read_text()
    assert len(text) <= contract.TERMINATION_LIMIT
    result = SaveResult.from_termination(0, text)
    assert (result.manifest_digest, result.bytes, result.graphs) == ("sha256:ab", 1, 2)


def _string_literals(path: Path) -> list[tuple[int, str]]:
    """String constants of a module, without docstrings and pydantic field descriptions."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant):
            skip.add(id(body[0].value))
        if isinstance(node, ast.keyword) and node.arg == "description":
            skip.update(id(n) for n in ast.walk(node.value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]


def test_contract_literals_live_only_in_the_contract() -> None:
    """No label/annotation key, run directory or sidecar port spelled out beside the contract."""
    files = [*sorted((ROOT / "operator" / "ember_operator").glob("*.py")),
             *sorted((ROOT / "sidecar" / "ember_sidecar").glob("*.py")), ROOT / "ember" / "handoff.py"]
    found = [f"{path.relative_to(ROOT)}:{line}: {text!r}" for path in files
             for line, text in _string_literals(path)
             if f"{contract.GROUP}/" in text or "/var/run/ember" in text or "/tmp/ember-run" in text
             or text in ("9400", "status.json", "load-attempt.json")]
    assert not found, "use ember.contract's names:\n" + "\n".join(found)
