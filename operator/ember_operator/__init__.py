"""ember operator: ModelDeployment and GraphArchive reconcilers (kopf), pure planning and builders.

Layers run one way: `handlers` (the only kopf import) → `reconcilers` (read, plan, apply) →
`planning`, `pools`, `archive_planning` (pure) → `pods`, `jobs`, `hpas` (pure builders) → `api`
(the one schema source). Keys, variables, paths and the API group shared with the sidecar and the
engine are `ember.contract`'s. `main.main()` is the entry point.
"""
