"""minisgl model plugin: Llama and Qwen3 families."""
