"""Training: optimiser, parallelism, resumable state, the loop, and whole runs."""
