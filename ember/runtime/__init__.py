"""Engine-side runtime: walk, SAVE, rebuild and LOAD CUDA graphs in the engine process."""
