"""CUDA graph mechanics: driver calls, walk (graph → archive form), rebuild (prepare, then build),
kernels, templates (the restored graphs of one archive and how they are launched)."""
