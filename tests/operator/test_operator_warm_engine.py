"""`warmPool.engine`: how an identity-keyed warm pod's engine idles (ready, or vLLM asleep). The mode
reaches the warm pods' engine container, is part of their pool key (a change replaces them, never
claims them), puts vLLM's sleep mode into every process of the deployment (SAVE included: it
allocates differently, so it is archive identity), and is refused for the transformers engine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from operator_helpers import CTX, md_spec
from pydantic import ValidationError

from ember import contract
from ember.engines.vllm.args import SLEEP_MODE_ARG
from ember_operator import naming
from ember_operator.observed import ArchiveView, PodView
from ember_operator.planning import archive_object, claim_for, template_of
from ember_operator.pools import WarmWant, plan_pools, pool_wants

VLLM = {"kind": "vllm", "version": "0.26.0", "image": "engine:test"}


def _spec(mode: str = "ready", args: list[str] | None = None) -> Any:
    return md_spec(engine={**VLLM, "args": args or []}, warmPool={"size": 2, "engine": mode})


def _archive(spec: Any) -> ArchiveView:
    h = spec.identity().hash()
    return ArchiveView(name=naming.archive_name(h), phase="Available", uri=f"s3://ember/archives/{h}/manifest",
                       digest="d" * 64)


def _wants(spec: Any) -> list[WarmWant]:
    archive = _archive(spec)
    return pool_wants(spec, {}, lambda shape: template_of("default", spec, CTX, shape),
                      lambda shape: claim_for("qwen", spec, archive, shape=shape), "uid-1")


def _engine_env(pod: dict[str, Any]) -> dict[str, Any]:
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == contract.ENGINE_CONTAINER]
    return {e["name"]: e.get("value") for e in engine["env"]}


def _view(pod: dict[str, Any]) -> PodView:
    meta = pod["metadata"]
    return PodView(name=meta["name"], labels=dict(meta["labels"]),
                   annotations={**meta["annotations"], contract.ANN_ENGINE: contract.ENGINE_READY},
                   phase="Running", ready=True, created=meta["name"])


def test_the_mode_reaches_the_warm_pods_engine() -> None:
    for mode in ("ready", "sleeping"):
        pods = plan_pools(_wants(_spec(mode)), []).creates
        assert len(pods) == 2
        assert {_engine_env(p)[contract.ENV_WARM_ENGINE] for p in pods} == {mode}


def test_a_mode_change_replaces_the_warm_pods_never_claims_them() -> None:
    # The sleep flag in engine.args already: the same identity and archive in both modes, so
    # only the mode tells the pools apart.
    ready, sleeping = _spec("ready", [SLEEP_MODE_ARG]), _spec("sleeping", [SLEEP_MODE_ARG])
    assert ready.identity().hash() == sleeping.identity().hash()
    pods = [_view(p) for p in plan_pools(_wants(sleeping), []).creates]
    plan = plan_pools(_wants(ready), pods, {p.name for p in pods})
    assert sorted(plan.deletes) == sorted(p.name for p in pods) and len(plan.creates) == 2
    assert {_engine_env(p)[contract.ENV_WARM_ENGINE] for p in plan.creates} == {"ready"}
    # and back: the pool of the other mode again
    again = plan_pools(_wants(sleeping), [_view(p) for p in plan.creates])
    assert len(again.deletes) == 2 and len(again.creates) == 2


def test_ready_keeps_the_pool_keys_of_deployments_that_never_set_it() -> None:
    unset = md_spec(engine=VLLM, warmPool={"size": 2})
    assert [w.key for w in _wants(unset)] == [w.key for w in _wants(_spec("ready"))]
    assert [w.key for w in _wants(unset)] != [w.key for w in _wants(_spec("sleeping"))]


def test_sleeping_runs_every_vllm_process_with_sleep_mode_and_is_identity() -> None:
    ready, sleeping = _spec("ready"), _spec("sleeping")
    assert sleeping.engine_run_args() == [SLEEP_MODE_ARG] and ready.engine_run_args() == []
    assert ready.identity().hash() != sleeping.identity().hash(), "another allocator: another archive"
    assert SLEEP_MODE_ARG in sleeping.identity().engine_args
    save = archive_object("a", "default", sleeping, CTX)
    assert save["spec"]["save"]["args"] == [SLEEP_MODE_ARG]
    # claims (warm and cold pods alike) start vLLM with it; only warm pods sleep (EMBER_WARM_ENGINE)
    claim = claim_for("qwen", sleeping, _archive(sleeping))
    assert claim.engine_args[-1] == SLEEP_MODE_ARG
    (pod,) = plan_pools(_wants(sleeping), []).creates[:1]
    assert json.loads(pod["metadata"]["annotations"][contract.ANN_ENGINE_ARGS])[-1] == SLEEP_MODE_ARG
    # given in engine.args already: not twice
    assert _spec("sleeping", [SLEEP_MODE_ARG]).engine_run_args() == [SLEEP_MODE_ARG]


def test_sleeping_is_refused_for_the_transformers_engine() -> None:
    with pytest.raises(ValidationError, match=r"sleeping needs engine\.kind vllm"):
        md_spec(warmPool={"size": 2, "engine": "sleeping"})
    assert md_spec(warmPool={"size": 2, "engine": "ready"}).warm_pool.engine == "ready"
