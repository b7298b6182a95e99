"""The model: `DecoderLM` and its parts (model), positions, the KV cache, hook points, the model
directory format (weights), LoRA layers (lora), closed-form counts (analysis) and the NumPy
reference (reference)."""
