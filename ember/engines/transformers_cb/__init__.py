"""transformers' continuous-batching engine (transformers 5.17)."""
