"""ember's built-in decode workloads (Llama / Qwen3 / MoE / Gemma shapes, random weights)."""
