"""`ember serve`: an OpenAI-compatible server over transformers continuous batching."""
