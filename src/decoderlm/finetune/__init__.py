"""Fine-tuning: sources (what a run starts from; loading a model directory with its adapters),
trainable (freezing, LoRA adapters on a model), merge (adapters folded into an ordinary model
directory: `decoderlm merge`) and counts (parameter, FLOP and memory counts with what trains:
`decoderlm params`, `decoderlm presets`)."""
