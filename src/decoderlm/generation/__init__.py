"""Generation: sampling and `generate` (generate), one-row CPU decoding kernels (cpu_decode)
and continuous batching (scheduler)."""
