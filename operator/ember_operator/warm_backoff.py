"""Back-off of warm pools whose pods keep failing (pure bookkeeping; the reconciler applies it).

A warm pod is dead when its engine failed (`ember.dev/engine: failed: …`), its engine container
exited or restarted, or the pod failed; the pool planner deletes it (`pools.plan_pools`). Each
dead pod of a pool (namespace + pool key, which includes the deployment for identity-keyed pools)
counts one failure; after the n-th failure in a row the pool's replacements wait
`min(max_s, base_s · 2^(n-1))` from that failure (10 s, 20 s, 40 s, … 5 min by default). A pod of
the pool whose engine says ready resets the count: the pool works again.

The state is in memory: an operator restart forgets it, and the first replacement after a restart
comes at once with the back-off starting over from `base_s`. That costs at most one extra pod per
failing pool per restart, and a failing pool's pods keep failing, so the back-off builds up again
within a few failures; a durable count would buy nothing worth a status field shared by the
deployments of a template-keyed pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ember import contract
from ember_operator.observed import PodView


def failure_reason(pod: PodView) -> str:
    """Why a dead warm pod is dead, in a few words ("" when it is not dead)."""
    if pod.engine.startswith(contract.ENGINE_FAILED):
        return pod.engine.removeprefix(contract.ENGINE_FAILED_PREFIX).removeprefix(contract.ENGINE_FAILED) \
            or "engine failed"
    if pod.engine_restarts > 0:
        return f"engine container restarted ({pod.engine_restarts}×)"
    if pod.engine_exited:
        return "engine container exited"
    if pod.failed:
        return f"pod {pod.phase}"
    return ""


@dataclass
class PoolFailures:
    """One pool's failures in a row: how many, when the last was seen (clock seconds), why."""

    count: int = 0
    last_at: float = 0.0
    reason: str = ""
    seen: set[tuple[str, str]] = field(default_factory=set)  # (pod name, creation time) counted


@dataclass(frozen=True)
class Failure:
    """A failure just counted: the pool's key, the pod, why, the count so far and the delay now."""

    key: str
    pod: str
    reason: str
    count: int
    delay_s: float


class WarmBackoff:
    def __init__(self, base_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_s, self.max_s, self.clock = base_s, max_s, clock
        self.pools: dict[tuple[str, str], PoolFailures] = {}

    def delay(self, count: int) -> float:
        """Seconds a pool waits after its `count`-th failure in a row (0 for none)."""
        if count <= 0 or self.base_s <= 0:
            return 0.0
        return min(self.max_s, self.base_s * 2 ** min(count - 1, 62))

    def observe(self, ns: str, warm: list[PodView]) -> list[Failure]:
        """Count the dead pods of `warm` (a namespace's warm pods) not counted before, and reset the
        pools with a ready engine; returns the failures counted now."""
        now, out = self.clock(), []
        for pod in warm:
            key = pod.pool_key
            if pod.engine_ready and not pod.deleting:
                self.pools.pop((ns, key), None)
                continue
            reason = failure_reason(pod)
            if not reason:
                continue
            state = self.pools.setdefault((ns, key), PoolFailures())
            if (pod.name, pod.created) in state.seen:
                continue
            state.seen = {s for s in state.seen if s[0] in {p.name for p in warm}} | {(pod.name, pod.created)}
            state.count, state.last_at, state.reason = state.count + 1, now, reason
            out.append(Failure(key, pod.name, reason, state.count, self.delay(state.count)))
        return out

    def wait(self, ns: str, key: str) -> float:
        """Seconds until the pool may get new pods (0: now)."""
        state = self.pools.get((ns, key))
        if state is None:
            return 0.0
        return max(0.0, state.last_at + self.delay(state.count) - self.clock())

    def failures(self, ns: str) -> dict[str, int]:
        """Pool key → failures in a row, for the namespace's pools that have any."""
        return {key: s.count for (n, key), s in self.pools.items() if n == ns and s.count}

    def forget(self, ns: str, keep: set[str]) -> None:
        """Drop the namespace's pools not in `keep` (no deployment asks for them any more)."""
        for n, key in [k for k in self.pools if k[0] == ns and k[1] not in keep]:
            del self.pools[(n, key)]
