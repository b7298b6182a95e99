"""Formats of other tools: Hugging Face GPT-2 checkpoints in and out (hf), Hugging Face
directories with their tokenizer, GPT-2 and Llama (hf_export), GGUF files for llama.cpp (gguf),
which models export where (targets) and the `decoderlm export` command (export)."""
