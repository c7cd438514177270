"""`ember-operator`: the operator's one entry point (wires settings, handlers and kopf together)."""

from __future__ import annotations

import argparse
import logging

import kopf

from ember_operator.handlers import configure, register
from ember_operator.settings import PREFIX, Settings


def parser() -> argparse.ArgumentParser:
    """No flags: `--help` lists the settings, each read from an environment variable."""
    lines = [f"  {PREFIX}{name.upper()}: {field.description or ''}"
             for name, field in Settings.model_fields.items()]
    return argparse.ArgumentParser(
        prog="ember-operator", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="ember's Kubernetes operator (kopf): reconciles ModelDeployments and GraphArchives.",
        epilog="settings (environment variables):\n" + "\n".join(lines),
    )


def main(argv: list[str] | None = None) -> None:
    parser().parse_args(argv)
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
