"""ember operator: ModelDeployment and GraphArchive reconcilers (kopf), pure planning and builders.

Layers run one way: `handlers` (the only kopf import) → `reconcilers` (read, plan, apply) →
`planning`, `pools`, `archives_plan` (pure) → `pods`, `jobs`, `hpas` (pure builders) → `api`
(the one schema source). `main.main()` is the entry point.
"""

GROUP = "ember.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
