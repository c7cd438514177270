"""CUDA graph mechanics: driver calls, walk (graph → archive form), rebuild, kernels, templates."""
