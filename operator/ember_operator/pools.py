"""Pure planning of warm pools: N unclaimed pods per pool key per namespace.

Two kinds of pool (`WarmWant`):

- **identity-keyed** (a shape whose archive is Available): the pods of one deployment, shape,
  archive (URI and manifest digest), engine arguments and warm engine mode (`warmPool.engine`,
  the engine container's EMBER_WARM_ENGINE), created with the hand-off data (the claim's
  annotations without the claim stamp) so the sidecar fetches and verifies at once and the engine
  loads before any claim. Owned by the deployment. A new digest, edited arguments or another
  mode make a new key: the old pool has no asker any more and is drained, its pods never claimed.
- **template-keyed** (a shape whose archive cannot be had: failing, pods capture natively): pods
  of one pod template (GPU, engine, store) shared by the namespace's deployments. vLLM pods learn
  their model with the claim, as cold pods do; a transformers pod runs the model and engine
  arguments of its command from its creation, so they are part of its template's key
  (`PodTemplate.serve_args`): shared only by deployments that serve the same.

A shape whose archive is on its way (no GraphArchive yet, Pending, Saving) has no warm pods: no
pod could be claimed for it before the archive is there, and pods made now would be replaced by
identity-keyed ones when it is.

A deployment's `warmPool.size` counts GPUs: `warm_split` spreads it over the GPU counts of its
current and alternative shapes (pods of 2 GPUs cannot serve a 1-GPU shape, nor the reverse); the
pods of a GPU count go to the first shape of that count (the current shape's first).

A pool's size is the largest ask among the deployments that share its key (one, for an
identity-keyed pool); pools no deployment asks for are drained. Claimed pods leave the pool (their
`ember.dev/pool` label becomes `serving`), so replenishing is just topping the pool back up. Warm
pods whose engine crashed (`ember.dev/engine: failed: …`, the engine container exited or restarted)
or whose pod failed are replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ember import contract
from ember.contract import Claim
from ember_operator import naming
from ember_operator.api import ModelDeploymentSpec, ShapeSpec
from ember_operator.observed import PodView
from ember_operator.pods import PodTemplate, bound_key, bound_warm_pod, warm_pod


def warm_pool_size(spec: ModelDeploymentSpec) -> tuple[int, str]:
    """The warm GPUs a deployment asks for, capped at its HPA's maxReplicas pods of its largest
    shape (more could never be claimed; each holds GPUs), and a warning when the cap applies."""
    size = spec.warm_pool.size
    widest = max(s.gpus for s in spec.parallelism.shapes())
    if spec.autoscaling is not None and size > spec.autoscaling.max_replicas * widest:
        cap = spec.autoscaling.max_replicas * widest
        return cap, (f"warmPool.size {size} is above autoscaling.maxReplicas × {widest} GPUs: keeping {cap} "
                     "warm GPUs (more could never be claimed)")
    return size, ""


def warm_split(spec: ModelDeploymentSpec) -> dict[int, int]:
    """GPU count → warm pods of that count: one pod per GPU count in turn (the current shape's
    first, then the alternatives'), while its GPUs fit in what is left of warmPool.size. So warm
    pods never hold more GPUs than warmPool.size, a 1-GPU deployment keeps warmPool.size pods, and
    a switch to an alternative finds warm pods of its GPU count when the budget allows one."""
    left = warm_pool_size(spec)[0]
    counts = list(dict.fromkeys(s.gpus for s in spec.parallelism.shapes()))
    split = dict.fromkeys(counts, 0)
    while any(g <= left for g in counts):
        for g in counts:
            if g <= left:
                split[g] += 1
                left -= g
    return split


@dataclass(frozen=True)
class WarmWant:
    """`size` warm pods of `template`: identity-keyed when `claim` is set (its hand-off data; the
    pods belong to `claim.deployment`, uid `owner_uid`; their engine idles as `warm_engine` says),
    else template-keyed (`prefetch`: a manifest its pods cache). Iterates as (template, size,
    prefetch)."""

    template: PodTemplate
    size: int
    prefetch: str = ""
    claim: Claim | None = None
    owner_uid: str = ""
    warm_engine: str = contract.WARM_ENGINE_READY

    @property
    def key(self) -> str:
        if self.claim is None:
            return self.template.pool_key
        return bound_key(self.template.pool_key, self.claim.deployment, self.claim, self.warm_engine)

    def pod(self, name: str, prefetch: list[str]) -> dict[str, Any]:
        if self.claim is None:
            return warm_pod(self.template, prefetch, name)
        return bound_warm_pod(self.template, self.claim, self.claim.deployment, self.owner_uid, name,
                              self.warm_engine)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.template, self.size, self.prefetch))


def pool_wants(
    spec: ModelDeploymentSpec, status: dict[str, Any], templates: Callable[[ShapeSpec], PodTemplate],
    bind: Callable[[ShapeSpec], Claim | bool | None] | None = None, owner_uid: str = "",
) -> list[WarmWant]:
    """The pools of one deployment, one entry per shape: identity-keyed where `bind` gives the
    shape's hand-off data (a Claim: its archive is Available), none where it says False (the
    archive is on its way), else template-keyed, prefetching the shape's archive URI if the
    status names one."""
    split, out = warm_split(spec), []
    uris = {(s.get("tensor"), s.get("expert"), s.get("data")): s.get("uri") or ""
            for s in status.get("shapes") or []}
    current_uri = (status.get("archive") or {}).get("uri") or ""
    for i, shape in enumerate(spec.parallelism.shapes()):
        size = split.pop(shape.gpus, 0)  # the pods go with the first shape of each GPU count
        claim = bind(shape) if bind is not None else None
        if isinstance(claim, Claim):
            out.append(WarmWant(templates(shape), size, claim=claim, owner_uid=owner_uid,
                                warm_engine=spec.warm_pool.engine.value))
        elif claim is False:
            out.append(WarmWant(templates(shape), 0))
        else:
            uri = (current_uri if i == 0 else "") or uris.get(shape.key(), "")
            out.append(WarmWant(templates(shape), size, uri))
    return out


@dataclass
class PoolPlan:
    creates: list[dict[str, Any]] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)
    patches: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # prefetch updates
    sizes: dict[str, int] = field(default_factory=dict)  # pool key → warm pods after the plan


def plan_pools(
    wanted: list[WarmWant] | list[tuple[PodTemplate, int, str]], warm: list[PodView],
    taken: set[str] | None = None,
) -> PoolPlan:
    """`wanted`: the pools of every deployment of one namespace (`WarmWant`, or (template, size,
    archive URI or "") for a template-keyed one); `warm`: its unclaimed warm pods; `taken`: names
    of every pod of the namespace (new warm pods get the lowest free names). Template-keyed warm
    pods prefetch the archives of their pool's deployments."""
    taken = {p.name for p in warm} | (taken or set())
    targets: dict[str, tuple[WarmWant, int]] = {}
    uris: dict[str, set[str]] = {}
    for item in wanted:
        want = item if isinstance(item, WarmWant) else WarmWant(*item)
        key = want.key
        if key not in targets or want.size > targets[key][1]:
            targets[key] = (want, want.size)
        if want.prefetch:
            uris.setdefault(key, set()).add(want.prefetch)
    by_key: dict[str, list[PodView]] = {}
    for pod in warm:
        if pod.deleting:
            continue
        by_key.setdefault(pod.labels.get(contract.LABEL_POOL_KEY, ""), []).append(pod)
    plan = PoolPlan()
    for key, pods in by_key.items():
        dead = [p for p in pods if p.failed or p.engine_crashed]
        plan.deletes += [p.name for p in dead]
        alive = [p for p in pods if not (p.failed or p.engine_crashed)]
        target = targets.get(key, (None, 0))[1]
        if len(alive) > target:
            # Drop the least useful first: engine not ready, not ready, then youngest.
            order = sorted(alive, key=lambda p: (p.engine_ready, p.ready, p.created, p.name))
            plan.deletes += [p.name for p in order[: len(alive) - target]]
        by_key[key] = alive
        prefetch = contract.prefetch_annotation(sorted(uris.get(key, set())))
        kept = set(plan.deletes)
        plan.patches += [
            (p.name, {"metadata": {"annotations": {contract.ANN_PREFETCH: prefetch}}})
            for p in alive
            if p.name not in kept and p.annotations.get(contract.ANN_PREFETCH, "[]") != prefetch
        ]
    for key, (want, size) in targets.items():
        have = len(by_key.get(key, []))
        manifests = sorted(uris.get(key, set()))
        names = naming.warm_pod_names(key, taken, max(0, size - have))
        plan.creates += [want.pod(name, manifests) for name in names]
        plan.sizes[key] = size
    for key, pods in by_key.items():
        plan.sizes.setdefault(key, min(len(pods), targets.get(key, (None, 0))[1]))
    return plan


def gpu_starved(pod: PodView) -> bool:
    """The scheduler cannot place the pod for want of GPUs (not a taint, selector or volume)."""
    return not pod.deleting and f"Insufficient {contract.GPU_RESOURCE}" in pod.unschedulable


def warm_to_yield(pending: list[PodView], warm: list[PodView], own_pool: str) -> list[str]:
    """Warm pods to delete so that serving pods the scheduler cannot place (too few GPUs) fit:
    for each pending pod, the placed, unclaimed warm pods of one node (of other pools than
    `own_pool`, whose pods it would rather claim): on the node whose warm GPUs cover it with the
    fewest given back, else on the node with the most warm GPUs. A pod the scheduler has nominated
    a node for is left to it: it preempts lower-priority (warm) pods there itself."""
    by_node: dict[str, list[PodView]] = {}
    for pod in warm:
        if pod.node and not pod.deleting and pod.gpus and pod.labels.get(contract.LABEL_POOL_KEY) != own_pool:
            by_node.setdefault(pod.node, []).append(pod)
    chosen: list[str] = []
    for pod in sorted((p for p in pending if not p.nominated), key=lambda p: -p.gpus):
        options = [(sum(w.gpus for w in ws), node) for node, ws in by_node.items()]
        if not options:
            break
        covering = [o for o in options if o[0] >= pod.gpus]
        # No node's warm GPUs cover it alone: the node with the most (its free GPUs may make up
        # the rest; if not, the pod is still pending on the next pass and more warm pods yield).
        _, node = min(covering) if covering else max(options)
        freed = 0
        for w in sorted(by_node.pop(node), key=lambda w: (-w.gpus, w.name)):
            if freed >= pod.gpus:
                break
            chosen.append(w.name)
            freed += w.gpus
    return chosen
