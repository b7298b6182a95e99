"""How many CPU threads training uses: `set_threads` (`decoderlm train --threads auto|N`).

torch's intra-op threads (OpenMP) wait for each other at the end of every parallel operator.
A narrow model gains little from a second thread, and when another program keeps a core busy
every operator waits for the thread whose core was taken. "auto" therefore times a few real
training steps at each candidate thread count, on this machine as it is loaded now, and keeps
the fastest. The OpenMP wait policy (the OMP_WAIT_POLICY environment variable, PASSIVE or
ACTIVE) is read once when torch loads, so it can only be set in the environment of the
command.
"""

from __future__ import annotations

import os
import time

import torch

from ..config import TrainConfig
from ..data import windows
from ..model import DecoderLM

__all__ = ["set_threads", "parse_threads", "thread_candidates"]


def parse_threads(threads: int | str | None) -> int | str | None:
    """None, "auto" or a positive integer (also given as text) up to os.cpu_count() (more
    threads than CPUs only wait for each other); ValueError otherwise."""
    if threads is None or threads == "auto":
        return threads
    n = int(threads) if str(threads).isdigit() and not isinstance(threads, bool) else 0
    if n < 1:
        raise ValueError(f"--threads must be auto or a positive integer, got {threads!r}")
    cpus = os.cpu_count() or 1
    if n > cpus:
        raise ValueError(
            f"--threads {n} is more than this machine's {cpus} CPUs; give at most {cpus}, or auto"
        )
    return n


def thread_candidates() -> list[int]:
    """1, 2, 4, ... up to the threads torch would use by default (the usable cores)."""
    most = max(1, torch.get_num_threads())
    return sorted({1, most, *(n for n in (2, 4, 8, 16, 32) if n < most)})


def _step_seconds(model: DecoderLM, cfg: TrainConfig, x, y, autocast, repeats: int) -> float:
    """The fastest of `repeats` forward + backward passes on (x, y), after one warm-up."""
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        with autocast():
            _, loss = model(x, y)
        loss.backward()
        if i:
            best = min(best, time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return best


def set_threads(
    threads: int | str | None, model: DecoderLM, cfg: TrainConfig, train_ids, autocast, log=print
) -> int:
    """Set torch's intra-op thread count and return it.

    Args:
        threads: None (leave torch's default), a positive integer, or "auto": time
            forward + backward on batch_size windows from the start of train_ids at each of
            `thread_candidates()` and keep the fastest. Neither the model's weights nor any
            RNG stream change (gradients are cleared, torch's RNG state is restored).
        model, cfg, train_ids, autocast: what will be trained (for "auto").
        log: where "auto" reports its timings.

    Raises:
        ValueError: threads is neither None, "auto" nor a positive integer up to
            os.cpu_count().
    """
    threads = parse_threads(threads)
    if threads is None:
        return torch.get_num_threads()
    if threads != "auto":
        torch.set_num_threads(threads)
        return threads
    if model.device.type != "cpu":
        return torch.get_num_threads()
    T, rng = model.config.block_size, torch.get_rng_state()
    x, y = windows(train_ids, torch.arange(cfg.batch_size) % (len(train_ids) - T), T)
    was_training, timings = model.training, {}
    model.train()
    for n in thread_candidates():
        torch.set_num_threads(n)
        timings[n] = _step_seconds(model, cfg, x.to(model.device), y.to(model.device), autocast, 2)
    model.train(was_training)
    torch.set_rng_state(rng)
    best = min(timings, key=timings.get)
    torch.set_num_threads(best)
    rates = ", ".join(f"{n}: {cfg.batch_size * T / s:,.0f}" for n, s in timings.items())
    log(f"threads: auto chose {best} (forward + backward tokens/s by threads: {rates})")
    return best
