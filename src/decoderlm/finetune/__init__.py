"""Fine-tuning: init_from (what a run started from another model's weights may change),
trainable (freezing, LoRA adapters on a model) and merge (adapters folded into an ordinary
model directory: `decoderlm merge`). Loading the model a fine-tune starts from, and a LoRA
run over its base: `decoderlm.io.load`."""
