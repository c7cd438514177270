"""Multi-GPU replicas and parallelism switches, planned without a cluster: the pod's GPUs and rank
layout, one-GPU SAVE Jobs for any shape, archives saved ahead for the alternatives, the warm-pool
split over GPU counts, and a switch step by step (incl. an edit back mid-switch)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from operator_helpers import CTX, NOW, md_spec, observed

from ember import contract
from ember.identity import Parallelism, canonical_json
from ember_operator import naming
from ember_operator.api import GraphArchiveSpec, MDPhase
from ember_operator.jobs import save_job
from ember_operator.observed import ArchiveView, PodView
from ember_operator.planning import Context, Plan, plan_deployment, revision_of, template_of
from ember_operator.pods import StoreAccess
from ember_operator.pools import pool_wants, warm_split

DP1 = {"tensor": 1, "expert": 1, "data": 1}
EP2 = {"tensor": 1, "expert": 2, "data": 2}
EP4 = {"tensor": 2, "expert": 4, "data": 2}
LOW = Context(sidecar_image=CTX.sidecar_image, default_store=CTX.default_store,
              presave_priority_class="ember-presave", store_endpoints=CTX.store_endpoints)


def _spec(shape: dict[str, int], alternatives: list[dict[str, int]] | None = None, **over: Any) -> Any:
    return md_spec(parallelism={**shape, "alternatives": alternatives or []}, **over)


def _archive(spec: Any, shape: Any = None) -> ArchiveView:
    h = spec.identity(shape).hash()
    return ArchiveView(name=naming.archive_name(h), phase="Available", uri=f"s3://b/e/archives/{h}/manifest",
                       digest="d" * 64)


def _pods(spec: Any, names: list[str], ready: bool = True, drain_at: str = "") -> list[PodView]:
    """Serving pods as the claim of `spec` (its current shape) leaves them."""
    ident = spec.identity()
    rev = revision_of(ident.hash(), template_of("default", spec, CTX), spec)
    view = _archive(spec)
    ann = {contract.ANN_ARCHIVE: view.uri, contract.ANN_MANIFEST_DIGEST: view.digest,
           contract.ANN_IDENTITY_SPEC: canonical_json(ident.canonical()).decode(),
           contract.ANN_WORLD: str(spec.gpu_count())}
    if drain_at:
        ann[contract.ANN_DRAIN] = drain_at
    pool = contract.POOL_DRAINING if drain_at else contract.POOL_SERVING
    return [PodView(name=n, labels={contract.LABEL_REVISION: rev, contract.LABEL_POOL: pool}, annotations=ann,
                    ready=ready, phase="Running", created=n) for n in names]


def _switch(spec: Any, pods: list[PodView], draining: list[PodView] | None = None, status: Any = None,
            now: Any = NOW) -> Plan:
    alts = {spec.identity(s).hash(): _archive(spec, s) for s in spec.parallelism.shapes()[1:]}
    fields: dict[str, Any] = {"archive": _archive(spec), "pods": pods, "draining": draining or [],
                              "alt_archives": alts, "now": now, "generation": 2}
    if status is not None:
        fields["status"] = status
    return plan_deployment(observed(spec, **fields), CTX)


def _reasons(plan: Plan) -> list[str]:
    return [e.reason for e in plan.events]


def test_a_replica_is_one_pod_of_tensor_x_data_gpus_at_rank_0_of_world_n() -> None:
    spec = _spec(EP4, gpu={"product": "NVIDIA-H100-80GB-HBM3"})  # gpu.count unset: tensor × data
    plan = _switch(spec, [])
    assert plan.claim is not None and (plan.claim.rank, plan.claim.world) == (0, 4)
    pod = plan.creates[0]
    assert pod["metadata"]["annotations"][contract.ANN_WORLD] == "4"
    assert pod["spec"]["containers"][0]["resources"]["limits"][contract.GPU_RESOURCE] == "4"
    assert json.loads(pod["metadata"]["annotations"][contract.ANN_IDENTITY_SPEC])["parallelism"] == {
        "tensor": 2, "expert": 4, "data": 2}


def test_save_job_of_any_shape_requests_one_gpu_and_alternatives_save_at_low_priority() -> None:
    spec = _spec(DP1, [EP4])
    plan = plan_deployment(observed(spec, archive=_archive(spec)), LOW)
    assert [p["metadata"]["name"] for p in plan.presaves] == [naming.archive_name(spec.identity(
        spec.parallelism.shapes()[1]).hash())]
    ga = GraphArchiveSpec.model_validate(plan.presaves[0]["spec"])
    assert ga.identity.parallelism.key() == (2, 4, 2)
    job = save_job(name="j", namespace="default", archive_name="ga", archive_uid="u", spec=ga,
                   store=StoreAccess.of(ga.store), sidecar_image="s", timeout_seconds=60, attempt=0)
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"][contract.GPU_RESOURCE] == "1"
    assert pod["priorityClassName"] == "ember-presave"
    assert json.loads(next(e["value"] for e in pod["containers"][0]["env"]
                           if e["name"] == contract.ENV_IDENTITY))["parallelism"]["tensor"] == 2
    # The current shape's own archive is not a presave: no priority class.
    own = plan_deployment(observed(spec), LOW).archive_create
    assert own is not None and "priorityClassName" not in own["spec"]["save"]
    # Both identities are labelled on the deployment (the archives have a user); shapes in status.
    shorts = {spec.identity(s).short() for s in spec.parallelism.shapes()}
    assert {k for k, v in plan.labels.items() if v} >= {f"ember.dev/uses-{s}" for s in shorts}
    assert [(s.gpus, s.current, s.phase) for s in plan.status.shapes] == [(1, True, "Available"),
                                                                          (4, False, "Pending")]


def test_vllm_data_parallel_replicas_of_a_dense_model_share_the_data_1_archive() -> None:
    """vLLM runs DP without EP as engines of one replica each: the shapes DP 1, 2 and 4 are one
    archive (no presave, no second SAVE), their pods differ only in vLLM's DP size and GPUs."""
    from ember.engines.vllm import args as vllm_args

    vllm = {"kind": "vllm", "version": "0.26.0", "image": "vllm:test"}
    dp2 = {"tensor": 1, "expert": 1, "data": 2}
    spec = _spec(dp2, [DP1, {"tensor": 1, "expert": 1, "data": 4}, EP2], engine=vllm)
    assert spec.identity() == _spec(DP1, engine=vllm).identity()
    assert spec.identity().parallelism == Parallelism()
    assert spec.identity(spec.parallelism.shapes()[3]).parallelism.data == 2, "EP keeps DP"
    plan = plan_deployment(observed(spec, archive=_archive(spec)), LOW)
    assert [p["metadata"]["name"] for p in plan.presaves] == [naming.archive_name(spec.identity(
        spec.parallelism.shapes()[3]).hash())], "only EP's archive is another one"
    assert [(s.data, s.phase) for s in plan.status.shapes] == [(2, "Available"), (1, "Available"),
                                                               (4, "Available"), (2, "Pending")]
    assert plan.claim is not None and plan.claim.world == 2
    args = list(plan.claim.engine_args)
    assert args == [*vllm_args.engine_args(spec.identity()), "--data-parallel-size", "2"]
    assert "--disable-custom-all-reduce" not in args, "one GPU's archive: no rank pins"
    # transformers keeps the shape in its identity (ember's decode engine captures DP itself)
    assert _spec(dp2).identity().parallelism.data == 2


def test_a_switch_between_dense_data_parallel_shapes_of_vllm_names_both_and_saves_nothing() -> None:
    """The shapes share the data-1 archive: a pod's data degree is its world over its tensor degree,
    not its identity's, so the switch still says which shape it leaves."""
    vllm = {"kind": "vllm", "version": "0.26.0", "image": "vllm:test"}
    dp2 = {"tensor": 1, "expert": 1, "data": 2}
    old_spec, new_spec = _spec(dp2, [DP1], engine=vllm), _spec(DP1, [dp2], engine=vllm)
    old = _pods(old_spec, ["old-0", "old-1"])
    assert {p.shape for p in old} == {(1, 1, 2)}
    start = _switch(new_spec, old)
    sw = start.status.switch
    assert sw is not None and sw.previous.key() == (1, 1, 2) and sw.target.key() == (1, 1, 1) and sw.presaved
    assert len(start.creates) == 2 and not start.presaves


def test_dropped_alternative_loses_its_label() -> None:
    spec = _spec(DP1)
    stale = "ember.dev/uses-0123456789abcdef"
    plan = plan_deployment(observed(spec, labels={stale: "true"}), CTX)
    assert plan.labels[stale] is None


def test_warm_pool_counts_gpus_round_robin_over_the_shapes_gpu_counts() -> None:
    assert warm_split(_spec(DP1, warmPool={"size": 3})) == {1: 3}
    assert warm_split(_spec(DP1, [EP2], warmPool={"size": 4})) == {1: 2, 2: 1}
    assert warm_split(_spec(DP1, [EP2], warmPool={"size": 3})) == {1: 1, 2: 1}
    assert warm_split(_spec(DP1, [EP2], warmPool={"size": 2})) == {1: 2, 2: 0}
    assert warm_split(_spec(EP2, [DP1, EP4], warmPool={"size": 8})) == {2: 1, 1: 2, 4: 1}
    for size in range(12):
        split = warm_split(_spec(DP1, [EP2, EP4], warmPool={"size": size}))
        assert sum(g * n for g, n in split.items()) <= size
    spec = _spec(DP1, [EP2], warmPool={"size": 4})
    status = {"archive": {"uri": "u1"}, "shapes": [{**DP1, "uri": "u1"}, {**EP2, "uri": "u2"}]}
    wants = pool_wants(spec, status, lambda shape: template_of("default", spec, CTX, shape))
    assert [(t.gpu_count, n, uri) for t, n, uri in wants] == [(1, 2, "u1"), (2, 1, "u2")]


def test_switch_new_pods_first_then_old_drain_then_deleted() -> None:
    old_spec, new_spec = _spec(DP1, [EP2]), _spec(EP2, [DP1])
    old = _pods(old_spec, ["old-0", "old-1"])
    start = _switch(new_spec, old)
    assert len(start.creates) == 2 and not start.drains and not start.deletes
    assert start.status.phase is MDPhase.switching
    sw = start.status.switch
    assert sw is not None and sw.previous.key() == (1, 1, 1) and sw.target.key() == (1, 2, 2) and sw.presaved
    assert "SwitchStarted" in _reasons(start)
    new = _pods(new_spec, ["new-0", "new-1"])
    half = _switch(new_spec, [*old, new[0], _pods(new_spec, ["new-1"], ready=False)[0]], status=start.status)
    assert half.drains == ["old-1"] or half.drains == ["old-0"]  # one old pod per ready new pod
    assert half.status.ready_replicas >= 2, "capacity never drops below the old shape's"
    full = _switch(new_spec, [*old, *new], status=half.status)
    assert sorted(full.drains) == ["old-0", "old-1"] and "NewShapeReady" in _reasons(full)
    assert "Draining" in _reasons(full) and full.requeue_after is not None
    assert full.status.replicas == 2 and full.status.switch is not None
    drained = _pods(old_spec, ["old-0", "old-1"], drain_at="2026-11-22T02:00:00.000000Z")
    waiting = _switch(new_spec, new, drained, status=full.status, now=NOW + timedelta(seconds=5))
    assert not waiting.deletes and waiting.status.phase is MDPhase.switching
    assert waiting.requeue_after is not None and 4.9 < waiting.requeue_after < 5.2
    gone = _switch(new_spec, new, drained, status=waiting.status, now=NOW + timedelta(seconds=11))
    assert sorted(gone.deletes) == ["old-0", "old-1"]  # the last old pods go: the switch is complete
    assert gone.status.switch is None and gone.status.phase is MDPhase.ready
    assert "SwitchComplete" in _reasons(gone)
    done = _switch(new_spec, new, [], status=gone.status, now=NOW + timedelta(seconds=12))
    assert done.status.switch is None and "SwitchComplete" not in _reasons(done)


def test_edit_back_mid_switch_puts_draining_pods_back() -> None:
    a, b = _spec(DP1, [EP2]), _spec(EP2, [DP1])
    a_draining = _pods(a, ["a-0", "a-1"], drain_at="2026-11-22T02:00:00.000000Z")
    b_serving = _pods(b, ["b-0", "b-1"])
    back = _switch(a, b_serving, a_draining, now=NOW + timedelta(seconds=2))
    assert sorted(back.undrains) == ["a-0", "a-1"] and not back.creates and not back.claims
    assert sorted(back.drains) == ["b-0", "b-1"]  # the undrained pods are Ready: B leaves
    assert back.status.switch is not None and back.status.switch.target.key() == (1, 1, 1)


def test_scale_up_during_a_switch_keeps_old_pods_until_the_new_count_is_ready() -> None:
    old_spec, new_spec = _spec(DP1, [EP2]), _spec(EP2, [DP1], replicas=4)
    old = _pods(old_spec, ["old-0", "old-1"])
    new = _pods(new_spec, ["new-0", "new-1"])
    plan = _switch(new_spec, [*old, *new])
    assert len(plan.creates) == 2 and not plan.drains, "2/4 new ready: both old pods keep serving"
