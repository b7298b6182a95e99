"""Models in and out of other formats, and loading a model from any of them: the one loader
(load: run directories, Hugging Face directories, GGUF files), LoRA adapter directories over
their base (adapters), Hugging Face GPT-2 (hf_gpt2) and Llama (hf_llama) checkpoints, their
weight files (hf_weights), whole Hugging Face directories with their tokenizer (hf), GGUF files
for llama.cpp (gguf), which models export where (targets) and the `decoderlm export` command
(export)."""
