"""`ember-operator`: the operator's one entry point (wires settings, handlers and kopf together)."""

from __future__ import annotations

import logging

import kopf

from ember_operator.handlers import configure, register
from ember_operator.settings import Settings


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # not a line per watch event
    ours = Settings.from_env()
    registry = kopf.OperatorRegistry()
    register(registry, ours)
    namespaces = ours.namespace_list()
    kopf.run(
        registry=registry,
        settings=configure(kopf.OperatorSettings(), ours),
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=True,  # no kopf peering: the Lease election (leader.py) gates the handlers
        liveness_endpoint=ours.liveness_endpoint or None,
    )


if __name__ == "__main__":
    main()
