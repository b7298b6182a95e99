"""Generation: sampling and `generate` (generate), the `decoderlm sample` command (sample),
one-row CPU decoding kernels (cpu_decode) and continuous batching (scheduler)."""
