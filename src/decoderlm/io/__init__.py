"""Formats of other tools: Hugging Face GPT-2 checkpoints in and out (hf)."""
