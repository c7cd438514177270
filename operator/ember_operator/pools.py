"""Pure planning of warm pools: N unclaimed pods per pod template (GPU, engine, store) per namespace.

A pool's size is the largest `warmPool.size` among the ModelDeployments that share its template;
pools no deployment asks for are drained. Claimed pods leave the pool (their `ember.dev/pool`
label becomes `serving`), so replenishing is just topping the pool back up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ember_operator import naming
from ember_operator.pods import PodTemplate, warm_pod
from ember_operator.views import PodView


@dataclass
class PoolPlan:
    creates: list[dict[str, Any]] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)  # pool key → warm pods after the plan


def plan_pools(wanted: list[tuple[PodTemplate, int]], warm: list[PodView]) -> PoolPlan:
    """`wanted`: (template, size) per deployment of one namespace; `warm`: its unclaimed warm pods."""
    targets: dict[str, tuple[PodTemplate, int]] = {}
    for template, size in wanted:
        key = template.pool_key
        if key not in targets or size > targets[key][1]:
            targets[key] = (template, size)
    by_key: dict[str, list[PodView]] = {}
    for pod in warm:
        if pod.deleting:
            continue
        by_key.setdefault(pod.labels.get(naming.POOL_KEY, ""), []).append(pod)
    plan = PoolPlan()
    for key, pods in by_key.items():
        dead = [p for p in pods if p.failed]
        plan.deletes += [p.name for p in dead]
        alive = [p for p in pods if not p.failed]
        target = targets.get(key, (None, 0))[1]
        if len(alive) > target:
            # Drop the least useful first: not ready, then youngest.
            order = sorted(alive, key=lambda p: (p.ready, p.created, p.name))
            plan.deletes += [p.name for p in order[: len(alive) - target]]
        by_key[key] = alive
    for key, (template, size) in targets.items():
        have = len(by_key.get(key, []))
        plan.creates += [warm_pod(template) for _ in range(max(0, size - have))]
        plan.sizes[key] = size
    for key, pods in by_key.items():
        plan.sizes.setdefault(key, min(len(pods), targets.get(key, (None, 0))[1]))
    return plan
