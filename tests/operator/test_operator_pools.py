"""Warm pool planning and settings."""

from __future__ import annotations

from operator_helpers import CTX, md_spec

from ember import contract
from ember_operator.observed import PodView
from ember_operator.planning import template_of
from ember_operator.pools import plan_pools
from ember_operator.settings import Settings


def _warm(name: str, key: str, ready: bool = True) -> PodView:
    return PodView(name=name, labels={contract.LABEL_POOL: "warm", contract.LABEL_POOL_KEY: key}, ready=ready,
                   phase="Running", created=name)


def test_pool_size_is_the_largest_ask_of_a_template() -> None:
    t = template_of("default", md_spec(), CTX)
    t_same = template_of("default", md_spec(replicas=5), CTX)
    plan = plan_pools([(t, 2, "s3://b/p/archives/1/manifest"), (t_same, 3, "")], [_warm("a", t.pool_key)])
    assert len(plan.creates) == 2 and plan.sizes[t.pool_key] == 3
    assert plan.creates[0]["metadata"]["labels"][contract.LABEL_POOL_KEY] == t.pool_key
    # Warm pods prefetch the pool's archives; existing ones are updated in place.
    assert plan.creates[0]["metadata"]["annotations"][contract.ANN_PREFETCH] == '["s3://b/p/archives/1/manifest"]'
    assert plan.patches == [("a", {"metadata": {"annotations": {
        contract.ANN_PREFETCH: '["s3://b/p/archives/1/manifest"]'}}})]


def test_warm_and_serving_pods_get_their_priority_classes() -> None:
    from dataclasses import replace

    from ember.contract import Claim
    from ember_operator.pods import serving_pod

    ctx = replace(CTX, warm_priority_class="ember-warm", serving_priority_class="ember-serving")
    t = template_of("default", md_spec(), ctx)
    assert t.pool_key == template_of("default", md_spec(), CTX).pool_key  # not part of the pool
    warm = plan_pools([(t, 1, "")], []).creates[0]
    assert warm["spec"]["priorityClassName"] == "ember-warm"
    cold = serving_pod(t, Claim(archive_uri="", identity="i", deployment="d", revision="r"), "d-r-0", "uid")
    assert cold["spec"]["priorityClassName"] == "ember-serving"
    # Unset: the default priority (no priorityClassName at all).
    plain = plan_pools([(template_of("default", md_spec(), CTX), 1, "")], []).creates[0]
    assert "priorityClassName" not in plain["spec"]


def test_pool_shrinks_not_ready_first_and_drains_orphans() -> None:
    t = template_of("default", md_spec(), CTX)
    warm = [_warm("a", t.pool_key), _warm("b", t.pool_key, ready=False), _warm("z", "orphan")]
    plan = plan_pools([(t, 1, "")], warm)
    assert sorted(plan.deletes) == ["b", "z"] and not plan.creates


def test_settings_from_env() -> None:
    s = Settings.from_env({"EMBER_OPERATOR_METRICS_PORT": "9100", "EMBER_OPERATOR_NAMESPACES": "a, b",
                           "EMBER_OPERATOR_STANDALONE": "true"})
    assert s.metrics_port == 9100 and s.namespace_list() == ["a", "b"] and s.standalone


def test_kopf_retries_api_requests_for_ever_with_capped_delays() -> None:
    """kopf gives a request up when its delays run out, and a watcher that gives up stops the
    operator (it exited after ~54 s of an apiserver answering 503): the delays never run out."""
    import itertools

    import kopf

    from ember_operator.handlers import API_RETRY_MAX_S, configure

    retries = configure(kopf.OperatorSettings(), Settings()).networking.error_backoffs
    assert not isinstance(retries, float | int)
    delays = list(itertools.islice(retries, 1000))
    assert delays[:4] == [1.0, 2.0, 4.0, 8.0] and max(delays) == delays[-1] == API_RETRY_MAX_S
    assert list(itertools.islice(retries, 2)) == [1.0, 2.0]  # every request starts afresh
