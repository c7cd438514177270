"""ember's benchmarks (`ember bench ...`); their synthetic archives come from `ember_testing`."""
