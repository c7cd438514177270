"""Warm pool planning and settings."""

from __future__ import annotations

from operator_helpers import CTX, md_spec

from ember import contract
from ember_operator.planning import template_of
from ember_operator.pools import plan_pools
from ember_operator.settings import Settings
from ember_operator.views import PodView


def _warm(name: str, key: str, ready: bool = True) -> PodView:
    return PodView(name=name, labels={contract.LABEL_POOL: "warm", contract.LABEL_POOL_KEY: key}, ready=ready,
                   phase="Running", created=name)


def test_pool_size_is_the_largest_ask_of_a_template() -> None:
    t = template_of("default", md_spec(), CTX)
    t_same = template_of("default", md_spec(model={"name": "other"}), CTX)
    plan = plan_pools([(t, 2, "s3://b/p/archives/1/manifest"), (t_same, 3, "")], [_warm("a", t.pool_key)])
    assert len(plan.creates) == 2 and plan.sizes[t.pool_key] == 3
    assert plan.creates[0]["metadata"]["labels"][contract.LABEL_POOL_KEY] == t.pool_key
    # Warm pods prefetch the pool's archives; existing ones are updated in place.
    assert plan.creates[0]["metadata"]["annotations"][contract.ANN_PREFETCH] == '["s3://b/p/archives/1/manifest"]'
    assert plan.patches == [("a", {"metadata": {"annotations": {
        contract.ANN_PREFETCH: '["s3://b/p/archives/1/manifest"]'}}})]


def test_pool_shrinks_not_ready_first_and_drains_orphans() -> None:
    t = template_of("default", md_spec(), CTX)
    warm = [_warm("a", t.pool_key), _warm("b", t.pool_key, ready=False), _warm("z", "orphan")]
    plan = plan_pools([(t, 1, "")], warm)
    assert sorted(plan.deletes) == ["b", "z"] and not plan.creates


def test_settings_from_env() -> None:
    s = Settings.from_env({"EMBER_OPERATOR_METRICS_PORT": "9100", "EMBER_OPERATOR_NAMESPACES": "a, b",
                           "EMBER_OPERATOR_STANDALONE": "true"})
    assert s.metrics_port == 9100 and s.namespace_list() == ["a", "b"] and s.standalone
