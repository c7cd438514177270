"""Identity-keyed warm pools, pure planning: which pools a deployment asks for, what their pods
carry, when they are replaced, which warm pods a claim may take, and the status counts."""

from __future__ import annotations

import json
from typing import Any

from operator_helpers import CTX, md_spec, observed

from ember import contract
from ember_operator import naming
from ember_operator.observed import ArchiveView, PodView
from ember_operator.planning import claim_for, plan_deployment, template_of
from ember_operator.pods import bound_key
from ember_operator.pools import WarmWant, plan_pools, pool_wants

DP1 = {"tensor": 1, "expert": 1, "data": 1}
VLLM = {"kind": "vllm", "version": "0.26.0", "image": "vllm:test"}
EP2 = {"tensor": 1, "expert": 2, "data": 2}


def _spec(**over: Any) -> Any:
    return md_spec(**{"warmPool": {"size": 2}, **over})


def _archive(spec: Any, shape: Any = None, digest: str = "d" * 64) -> ArchiveView:
    h = spec.identity(shape).hash()
    return ArchiveView(name=naming.archive_name(h), phase="Available", uri=f"s3://ember/archives/{h}/manifest",
                       digest=digest)


def _wants(spec: Any, archives: dict[str, ArchiveView], name: str = "qwen") -> list[WarmWant]:
    def bind(shape: Any) -> Any:  # as the reconciler's
        archive = archives.get(naming.archive_name(spec.identity(shape).hash()))
        if archive is None or not (archive.available or archive.failing):
            return False
        return claim_for(name, spec, archive, shape=shape) if archive.available else None

    return pool_wants(spec, {}, lambda shape: template_of("default", spec, CTX, shape), bind, "uid-1")


def _as_view(pod: dict[str, Any], engine: str = "", **over: Any) -> PodView:
    meta = pod["metadata"]
    ann = {**meta["annotations"], **({contract.ANN_ENGINE: engine} if engine else {})}
    return PodView(name=meta["name"], labels=dict(meta["labels"]), annotations=ann, phase="Running",
                   ready=True, created=meta["name"], **over)


def test_available_archive_gets_an_identity_keyed_pool_a_failing_one_the_shared_one() -> None:
    spec = _spec(parallelism={**DP1, "alternatives": [EP2]}, warmPool={"size": 4})
    ep2 = spec.parallelism.shapes()[1]
    failing = ArchiveView(name=naming.archive_name(spec.identity(ep2).hash()), phase="Failed")
    current, alternative = _wants(spec, {a.name: a for a in [_archive(spec), failing]})
    assert current.claim is not None and current.size == 2
    assert current.key == bound_key(template_of("default", spec, CTX).pool_key, "qwen", current.claim)
    assert alternative.claim is None and alternative.size == 1
    assert alternative.key == template_of("default", spec, CTX, ep2).pool_key
    # EP2's archive on its way (Saving, or no GraphArchive yet): no warm pods for it until it is there.
    saving = ArchiveView(name=failing.name, phase="Saving", reason="SaveRunning")
    current_only = {_archive(spec).name: _archive(spec)}
    for archives in ({**current_only, saving.name: saving}, current_only):
        assert [w.size for w in _wants(spec, archives)] == [2, 0]


def test_identity_keyed_warm_pods_carry_the_hand_off_data_and_no_serving_labels() -> None:
    spec = _spec(archive={"signing": {"trustedKeys": [{"id": "k1", "publicKey": "A" * 43 + "="}]}})
    archive = _archive(spec)
    plan = plan_pools(_wants(spec, {archive.name: archive}), [])
    assert len(plan.creates) == 2
    pod = plan.creates[0]
    labels, ann = pod["metadata"]["labels"], pod["metadata"]["annotations"]
    assert labels[contract.LABEL_POOL] == contract.POOL_WARM and labels[contract.LABEL_WARM_FOR] == "qwen"
    assert contract.LABEL_DEPLOYMENT not in labels, "no Service, InferencePool or HPA selector matches it"
    assert ann[contract.ANN_ARCHIVE] == archive.uri and ann[contract.ANN_MANIFEST_DIGEST] == archive.digest
    ident = spec.identity()
    assert ann[contract.ANN_IDENTITY] == ident.hash()
    assert json.loads(ann[contract.ANN_IDENTITY_SPEC])["model"] == "Qwen/Qwen3-0.6B"
    assert (ann[contract.ANN_RANK], ann[contract.ANN_WORLD]) == ("0", "1")
    # transformers: the pod's own `ember serve` arguments (its command's: contract.serve_args)
    assert json.loads(ann[contract.ANN_ENGINE_ARGS]) == ["--model", "Qwen/Qwen3-0.6B"]
    engine = pod["spec"]["containers"][0]
    assert engine["command"][-2:] == ["--model", "Qwen/Qwen3-0.6B"]
    assert contract.ANN_CLAIMED_AT not in ann, "not claimed: the claim writes the stamp"
    assert pod["metadata"]["ownerReferences"][0]["name"] == "qwen"
    envs = {e["name"]: e.get("value") for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]
            for e in c.get("env", [])}
    assert "k1" in (envs[contract.ENV_TRUSTED_KEYS] or "")
    # The sidecar reads the same claim back (it restores before any claim).
    claim = contract.Claim.from_annotations(ann)
    assert claim is not None and claim.manifest_digest == archive.digest and claim.claimed_at is None


def test_a_new_digest_or_new_engine_args_replace_the_pool_never_claim_it() -> None:
    spec = _spec(engine=VLLM)
    old = _archive(spec)
    pods = [_as_view(p, "ready") for p in plan_pools(_wants(spec, {old.name: old}), []).creates]
    replaced = _archive(spec, digest="e" * 64)
    plan = plan_pools(_wants(spec, {replaced.name: replaced}), pods, {p.name for p in pods})
    assert sorted(plan.deletes) == sorted(p.name for p in pods) and len(plan.creates) == 2
    assert {c["metadata"]["annotations"][contract.ANN_MANIFEST_DIGEST] for c in plan.creates} == {"e" * 64}
    # A claim of the new digest takes none of the old pods (ready as they are): cold pods instead.
    got = plan_deployment(observed(spec, archive=replaced, bound=pods), CTX)
    assert not got.claims and len(got.creates) == 2
    # --served-model-name is not identity (same archive) but it is an engine argument: new pool.
    edited = _spec(engine={**spec.engine.model_dump(by_alias=True), "args": ["--served-model-name", "q"]})
    assert edited.identity().hash() == spec.identity().hash()
    plan = plan_pools(_wants(edited, {old.name: old}), pods, {p.name for p in pods})
    assert sorted(plan.deletes) == sorted(p.name for p in pods) and len(plan.creates) == 2
    assert {json.dumps(json.loads(c["metadata"]["annotations"][contract.ANN_ENGINE_ARGS])[-2:])
            for c in plan.creates} == {json.dumps(["--served-model-name", "q"])}


def test_only_engine_ready_pods_of_the_claim_are_claimed_ready_first_then_cold() -> None:
    spec = _spec(replicas=3, warmPool={"size": 3})
    archive = _archive(spec)
    made = plan_pools(_wants(spec, {archive.name: archive}), []).creates
    ready, loading = _as_view(made[0], "ready"), _as_view(made[1], "loading")
    failed = _as_view(made[2], "failed: x")
    plan = plan_deployment(observed(spec, archive=archive, bound=[loading, failed, ready]), CTX)
    assert [name for name, _ in plan.claims] == [ready.name]
    patch = plan.claims[0][1]["metadata"]
    assert patch["labels"][contract.LABEL_POOL] == contract.POOL_SERVING
    assert patch["labels"][contract.LABEL_DEPLOYMENT] == "qwen"
    assert contract.ANN_CLAIMED_AT in patch["annotations"]
    assert patch["annotations"][contract.ANN_MANIFEST_DIGEST] == archive.digest
    assert len(plan.creates) == 2, "the loading and the failed pod are not claimed: cold pods instead"
    assert (plan.status.warm_ready, plan.status.warm_loading) == (0, 1), "the claimed one left the pool"
    # Before a scale-up: the counts of the pool as it is.
    idle = plan_deployment(observed(_spec(replicas=0, warmPool={"size": 3}), archive=archive,
                                    bound=[ready, loading, failed]), CTX)
    assert (idle.status.warm_ready, idle.status.warm_loading) == (1, 1)


def test_a_crashed_warm_engine_is_replaced() -> None:
    spec = _spec()
    archive = _archive(spec)
    made = plan_pools(_wants(spec, {archive.name: archive}), []).creates
    said_failed = _as_view(made[0], "failed: engine exited")
    restarted = _as_view(made[1], "ready", engine_restarts=1)
    plan = plan_pools(_wants(spec, {archive.name: archive}), [said_failed, restarted],
                      {said_failed.name, restarted.name})
    assert sorted(plan.deletes) == sorted([said_failed.name, restarted.name])
    assert len(plan.creates) == 2 and plan.sizes[said_failed.pool_key] == 2


def test_pod_view_reads_the_engine_containers_restarts_and_exit() -> None:
    def pod(**status: Any) -> PodView:
        return PodView.of({"metadata": {"name": "p"}, "status": {"containerStatuses": [
            {"name": "ember-sidecar", "restartCount": 5}, {"name": contract.ENGINE_CONTAINER, **status}]}})

    assert not pod(restartCount=0, state={"running": {}}).engine_crashed
    assert pod(restartCount=2, state={"running": {}}).engine_crashed
    assert pod(restartCount=0, state={"terminated": {"exitCode": 139}}).engine_crashed
    assert PodView(name="p", annotations={contract.ANN_ENGINE: "failed: oom"}).engine_crashed
    assert not PodView(name="p", annotations={contract.ANN_ENGINE: "loading"}).engine_ready
