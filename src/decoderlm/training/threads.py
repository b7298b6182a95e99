"""How many CPU threads training uses: `set_threads` (`decoderlm train --threads auto|N`).

torch's intra-op threads (OpenMP) wait for each other at the end of every parallel operator.
A narrow model gains little from a second thread, and when another program keeps a core busy
every operator waits for the thread whose core was taken. "auto" therefore times a few real
training steps at each candidate thread count, on this machine as it is loaded now, and keeps
the fastest, and during training `ThreadTuner` keeps checking: when steps slow down (another
program took a core) or every few hundred steps, it times a few real training steps at each
other candidate and moves to the fastest. The OpenMP wait policy (the OMP_WAIT_POLICY
environment variable, PASSIVE or ACTIVE) is read once when torch loads, so it can only be set
in the environment of the command.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from ..config import TrainConfig
from ..data.corpus import window_count, windows
from ..model.model import DecoderLM
from ..options import parse_threads

__all__ = ["set_threads", "parse_threads", "thread_candidates", "busy_machine_hint", "ThreadTuner"]


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
        UserError: threads is neither None, "auto" nor a positive integer up to
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
    starts = torch.arange(cfg.data.batch_size) % window_count(train_ids, T)
    x, y = windows(train_ids, starts, T)
    was_training, timings = model.training, {}
    model.train()
    for n in thread_candidates():
        torch.set_num_threads(n)
        timings[n] = _step_seconds(model, cfg, x.to(model.device), y.to(model.device), autocast, 2)
    model.train(was_training)
    torch.set_rng_state(rng)
    best = min(timings, key=timings.get)
    torch.set_num_threads(best)
    rates = ", ".join(f"{n}: {cfg.data.batch_size * T / s:,.0f}" for n, s in timings.items())
    log(f"threads: auto chose {best} (forward + backward tokens/s by threads: {rates})")
    return best


def busy_machine_hint(threads: int, load_average=None, cpus: int | None = None) -> str | None:
    """One line suggesting --threads when other programs keep busy the cores that `threads`
    torch threads need, else None.

    Every parallel operator waits for its slowest thread, so when the 1-minute load average
    leaves fewer idle CPUs than there are threads (load >= cpus - threads + 1) each step waits
    for a thread whose core another program holds, often several times slower than one thread.

    Args:
        threads: torch's intra-op thread count.
        load_average: a function giving (1, 5, 15)-minute load averages (default
            os.getloadavg; where the system has none there is no hint).
        cpus: the CPUs (default os.cpu_count()).
    """
    cpus = cpus or os.cpu_count() or 1
    try:
        load = (load_average or os.getloadavg)()[0]
    except (AttributeError, OSError):  # no load average on this system
        return None
    if threads < 2 or load < cpus - threads + 1:
        return None
    return (
        f"note: this machine is busy (load average {load:.1f} on {cpus} CPUs) and torch "
        f"uses {threads} threads, which wait for the busy cores: --threads 1 or --threads "
        "auto may train several times faster (the default thread count is left as it is)"
    )


class ThreadTuner:
    """`--threads auto` while training: follows the machine's load by moving torch's thread
    count to whichever candidate (`thread_candidates()`) runs the current steps fastest.

    The training loop calls `step_done(seconds)` after each optimizer step. The tuner keeps
    the median of the last `window` step times at the current count. It probes when that
    median is `slowdown` times the one it chose the count on (the load changed), and anyway
    every `every` steps (the load may have gone): it runs the next `probe_steps` real steps
    at each other candidate, then keeps the count with the lowest median step time. Probes
    are training steps, so nothing is wasted but the slower steps of a worse count.

    Different thread counts may round float sums differently, so a run whose count moved is
    not bitwise the run of a fixed count; give --threads N for that.
    """

    def __init__(
        self,
        log: Callable[[str], None] = print,
        window: int = 10,
        probe_steps: int = 5,
        every: int = 300,
        slowdown: float = 1.3,
    ):
        self.log, self.window, self.probe_steps = log, window, probe_steps
        self.every, self.slowdown = every, slowdown
        self.candidates = thread_candidates()
        self.current = torch.get_num_threads()
        self.recent: list[float] = []  # step seconds at the current count
        self.chosen_on: float | None = None  # the median the current count was chosen on
        self.since_probe = 0
        self.probing: list[int] = []  # candidates still to time, the one running first
        self.trials: dict[int, list[float]] = {}

    def step_done(self, seconds: float) -> None:
        """Record one optimizer step's wall time; may change torch's thread count."""
        if self.probing:
            self._probe_step(seconds)
            return
        self.recent = [*self.recent[-(self.window - 1) :], seconds]
        self.since_probe += 1
        if len(self.recent) < self.window:
            return
        median = statistics.median(self.recent)
        if self.chosen_on is None:
            self.chosen_on = median
        slower = median > self.slowdown * self.chosen_on
        if (slower or self.since_probe >= self.every) and len(self.candidates) > 1:
            self.trials = {self.current: self.recent[-self.probe_steps :]}
            self.probing = [n for n in self.candidates if n != self.current]
            torch.set_num_threads(self.probing[0])

    def _probe_step(self, seconds: float) -> None:
        n = self.probing[0]
        self.trials.setdefault(n, []).append(seconds)
        if len(self.trials[n]) < self.probe_steps:
            return
        self.probing.pop(0)
        if self.probing:
            torch.set_num_threads(self.probing[0])
            return
        medians = {n: statistics.median(t) for n, t in self.trials.items()}
        best = min(medians, key=medians.get)
        if best != self.current:
            rates = ", ".join(f"{n}: {s * 1000:.0f} ms" for n, s in medians.items())
            self.log(f"threads: auto moved from {self.current} to {best} (step time: {rates})")
        torch.set_num_threads(best)
        self.current, self.chosen_on = best, medians[best]
        self.recent, self.since_probe = [], 0
