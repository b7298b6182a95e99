"""Fine-tuning: sources (what a run starts from; loading a model directory with its adapters),
trainable (freezing, LoRA adapters on a model) and merge (adapters folded into an ordinary
model directory: `decoderlm merge`)."""
