"""ember's test support: synthetic archives, archives written into a store, and the local
cluster's helpers (kwok GPU nodes, kubectl), for the tests, the benchmarks and the e2e demo.

Shipped in the wheel beside the benchmarks (`ember bench parse/fetch/claims` build on it); it
imports the core only (pyproject.toml [tool.importlinter]), and nothing but the tests, the
benchmarks and e2e/demo.sh imports it.

- `ember_testing.synthetic`: GraphSets shaped like LLM decode captures and their fake kernel
  images (no CUDA).
- `ember_testing.archives`: sample identities; blob archives and real archives put into a store.
- `ember_testing.cluster`: the local control plane's env file, fake GPU nodes, `kubectl apply`,
  `EngineStandIn` (ready engines on kwok's warm pods).
"""
