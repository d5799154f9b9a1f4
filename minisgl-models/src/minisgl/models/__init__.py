"""minisgl model plugin: the Llama family (Llama, SmolLM2, Qwen2, Qwen3, Mistral)."""
