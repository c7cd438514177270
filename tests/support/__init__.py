"""The tests' own support, shared across their folders (importable as `support`: tests/conftest.py
puts tests/ on sys.path). Pytest-side helpers only; what the benchmarks share with the tests
(synthetic archives, archives in a store, kwok GPU nodes, the e2e env file) is `ember_testing`.

- `support.cluster`: session fixtures for the real local control plane (`k8s`) and MinIO (`minio`),
  registered in tests/conftest.py.
- `support.gpu_gate`: whether a GPU is present, and EMBER_REQUIRE_GPU=1 (skips become failures).
- `support.sidecar`: fakes for the sidecar's tests (a throttling proxy, a recording reporter).
- `support.confine`: run a process as an unprivileged user in a read-only mount namespace.
"""
