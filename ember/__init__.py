"""ember: restore saved CUDA graphs so LLM serving pods start in about a second.

The core package: archive identity, the archive format and stores, the native-library
bindings, the engine-side graph runtime and the `ember` command line. The operator lives in
`ember_operator`, the sidecar in `ember_sidecar`.
"""

__version__ = "0.1.0"
