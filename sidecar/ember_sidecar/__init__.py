"""ember's sidecar: claim watch, archive fetch + verify, handoff to the engine, restore metrics.

Entry point: `ember-sidecar` (`ember_sidecar.main:main`). See docs/sidecar.md.
"""
