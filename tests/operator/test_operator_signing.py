"""Archive signing in the operator's builders: the SAVE Job mounts the signing Secret (from the
deployment, else the operator's default) and signs with it; the serving and warm pods' sidecar and
engine get the deployment's trusted keys; no signing settings → nothing changes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from operator_helpers import CTX, md_spec

from ember import contract
from ember.archive import signing
from ember_operator import naming
from ember_operator.api import GraphArchiveSpec, ModelDeploymentSpec
from ember_operator.jobs import save_job
from ember_operator.planning import Context, archive_object, template_of
from ember_operator.pods import StoreAccess, warm_pod

KEYS = [{"id": "2026-q3", "publicKey": signing.public_key_text(signing.Ed25519PrivateKey.generate())},
        {"id": "2026-q4", "publicKey": signing.public_key_text(signing.Ed25519PrivateKey.generate())}]


def _job(spec: ModelDeploymentSpec, ctx: Context = CTX) -> dict[str, Any]:
    ga_spec = GraphArchiveSpec.model_validate(archive_object("ga-x", "default", spec, ctx)["spec"])
    return save_job(name=naming.save_job_name(ga_spec.identity_hash, 0), namespace="default",
                    archive_name="ga-x", archive_uid="u", spec=ga_spec, store=StoreAccess.of(ga_spec.store),
                    sidecar_image="ember:test", timeout_seconds=600, attempt=0)["spec"]["template"]["spec"]


def test_save_job_mounts_the_signing_secret_and_signs_with_it() -> None:
    pod = _job(md_spec(archive={"signing": {"secretName": "ember-signing-key"}}))
    c = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[contract.ENV_SIGNING_KEY] == contract.SIGNING_KEY_PATH
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if v["name"] == "ember-signing")
    assert volume["secret"]["secretName"] == "ember-signing-key"
    key = contract.SIGNING_SECRET_KEY
    assert volume["secret"]["items"] == [{"key": key, "path": key}]
    assert mounts["ember-signing"]["mountPath"] == contract.SIGNING_KEY_DIR
    assert mounts["ember-signing"]["readOnly"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True  # the key is a mount, not a file written


def test_operator_default_signing_secret_and_none() -> None:
    pod = _job(md_spec(), replace(CTX, signing_secret="cluster-signing"))
    volume = next(v for v in pod["volumes"] if v["name"] == "ember-signing")
    assert volume["secret"]["secretName"] == "cluster-signing"
    unsigned = _job(md_spec())
    assert not any(v["name"] == "ember-signing" for v in unsigned["volumes"])
    assert contract.ENV_SIGNING_KEY not in {e["name"] for e in unsigned["containers"][0]["env"]}


def test_serving_pods_get_the_trusted_keys() -> None:
    spec = md_spec(archive={"signing": {"trustedKeys": KEYS}})
    t = template_of("default", spec, CTX)
    pod = warm_pod(t)["spec"]
    sidecar = next(c for c in pod["initContainers"] if c["name"] == contract.SIDECAR_CONTAINER)
    engine = next(c for c in pod["containers"] if c["name"] == contract.ENGINE_CONTAINER)
    for c in (sidecar, engine):
        raw = {e["name"]: e.get("value") for e in c["env"]}[contract.ENV_TRUSTED_KEYS]
        keys = signing.parse_trusted_keys(raw)  # what the sidecar and LOAD read back
        assert [k.name for k in keys] == ["2026-q3", "2026-q4"]
    # a trust list is part of the pool: pods of another list are not shared; none → the old key
    plain = template_of("default", md_spec(), CTX)
    assert t.pool_key != plain.pool_key
    assert contract.ENV_TRUSTED_KEYS not in {e["name"] for c in warm_pod(plain)["spec"]["containers"]
                                             for e in c["env"]}


def test_crds_carry_the_signing_fields() -> None:
    import yaml

    from ember_operator.crdgen import ROOT

    crd = yaml.safe_load((ROOT / "crds" / "modeldeployments.ember.dev.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    sig = spec["archive"]["properties"]["signing"]["properties"]
    assert set(sig) == {"secretName", "trustedKeys"}
    assert set(sig["trustedKeys"]["items"]["properties"]) == {"id", "publicKey"}
    ga = yaml.safe_load((ROOT / "crds" / "grapharchives.ember.dev.yaml").read_text())
    save = ga["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["save"]
    assert "signingSecret" in save["properties"]
