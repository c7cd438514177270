"""Faults the tests inject to prove LOAD's canary refuses them: `EMBER_FAULT=name[,name]`.
Nothing sets it outside tests; each name is read where its fault lives.

- `view-offset`: the decode workload's EP layer takes a rank's experts through a view offset, so
  SAVE freezes rank 0's offset into the graphs (a per-rank value frozen at SAVE);
- `stale-update`: an exec update loads the graph the template held before, not the one asked for
  (a stale template update: the template then computes another key's step);
- `splice-redop`: LOAD splices each rank's collectives with a max where the archive's table says
  sum (a wrong splice: the all-reduce and reduce-scatter compute something else).
"""

from __future__ import annotations

from ember import settings

NAMES = ("view-offset", "stale-update", "splice-redop")


def active(name: str) -> bool:
    assert name in NAMES, name
    return name in settings.text("EMBER_FAULT").split(",")
