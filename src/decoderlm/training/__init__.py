"""Training: optim (AdamW, Muon and the learning-rate schedule), parallel (attention choice,
activation checkpointing, DDP / FSDP2, torch.compile), checkpoints (the files of a resumable
checkpoint), state (TrainState), loop (train, train_step), threads (CPU threads), launch
(torchrun), metrics (derived metrics and their sinks), artifacts (what a run writes after
training: samples, plots, the report), plan (what a run was asked for and what it trains:
RunRequest, RunPlan), run_dir (the run directory's files, checks and preparation) and run
(run_experiment, the `decoderlm train` command)."""
