"""ember's benchmarks (`ember bench ...`) and the synthetic archives they and the tests use."""
