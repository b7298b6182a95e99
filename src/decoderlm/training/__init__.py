"""Training: optim (AdamW and the learning-rate schedule), parallel (attention choice,
activation checkpointing, DDP / FSDP2, torch.compile), checkpoints (the files of a resumable
checkpoint), state (TrainState), loop (train, train_step) and run (run_experiment)."""
