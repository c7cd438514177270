"""vLLM 0.26 as an ember engine: the adapter, its key enumeration, version check and plugin."""
