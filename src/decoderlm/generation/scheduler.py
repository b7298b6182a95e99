"""Continuous batching: one thread decodes every active sequence of a server together.

A `Scheduler` owns the model's decoding. Requests `submit` a `Sequence` (prompt ids, sampling
settings, seed, how many tokens); between forward passes the scheduler admits waiting
sequences (up to max_batch_size at once; the rest queue in arrival order) and drops finished
or cancelled ones. Admitted sequences are prefilled (one forward pass over the prompts of each
length, into a `KVCache`) and then join the `SlotKVCache`; each step is one
forward pass of one new token for every active sequence, each at its own position, and each
sequence then samples with its own temperature, top-k, top-p and torch.Generator. A greedy
sequence therefore gets the tokens it would get alone (up to float rounding of the batched
products). Past max_positions the context slides as in `generate`: the sequence's cache is
rebuilt from its last max_positions tokens (the rows sliding at one step in one forward pass).

Tokens go back through each sequence's `emit` callback as `Token`s, then None at the end (or
the exception that ended it); a sequence given a stop_id (the end-of-text token) ends after
emitting it. Stop texts are the caller's business: it calls `cancel` and the sequence leaves
the batch before the next step.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..model.kv_cache import KVCache, SlotKVCache
from . import cpu_decode
from .generate import decode_step, sample_next
from .precision import activation_dtype

__all__ = ["Scheduler", "Sequence", "Token"]


@dataclass(frozen=True)
class Token:
    """One generated token: its id, and when asked for, its log-probability (nats, the
    log-softmax of the raw logits) and the top_logprobs most likely (id, log-probability)
    pairs, most likely first."""

    id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)
class Sequence:
    """One continuation to generate.

    Attributes:
        prompt: the prompt's token ids (at least one).
        max_new_tokens: how many tokens to generate at most (>= 1).
        emit: called from the scheduler's thread with each `Token`, then None once done, or
            an Exception that ended the sequence.
        temperature, top_k, top_p: sampling settings (see `sample_next`).
        seed: seeds this sequence's own torch.Generator (None: the global RNG).
        logprobs: None, or k >= 0: compute each token's log-probability and its top k.
        stop_id: a token id (the end-of-text token) that ends the sequence: it is emitted,
            then None (None: no such id).
    """

    prompt: list[int]
    max_new_tokens: int
    emit: Callable[[Token | Exception | None], None]
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: int | None = None
    stop_id: int | None = None
    ids: list[int] = field(default_factory=list)  # prompt + generated so far
    generator: torch.Generator | None = None
    cancelled: bool = False

    def cancel(self) -> None:
        """Ask for no more tokens: the sequence leaves the batch before the next step."""
        self.cancelled = True

    def fail(self, error: Exception) -> None:
        """End the sequence with `error` (emitted in place of the next token)."""
        self.cancelled = True
        self.emit(error)


class Scheduler:
    """The decoding thread of a model served to concurrent requests.

    Args:
        model: the DecoderLM (eval mode).
        vocab_size: only ids below it are sampled or scored (the tokenizer's ids, when the
            model has logits for more).
        max_batch_size: the most sequences decoded together; more wait in a queue.
        step: the function computing one new token's logits, (model, idx [B, 1] int64,
            cache, positions [B, 1] int64) -> [B, 1, vocab_size]; default: `decode_step`'s.
        compile: the default step is the torch.compile'd one (see `decode_step`).
    """

    def __init__(
        self, model, vocab_size: int, max_batch_size: int = 8, step=None, compile: bool = False
    ):
        self.model, self.vocab_size, self.max_batch_size = model, vocab_size, max_batch_size
        self._step = step or decode_step(compile)
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._active: list[Sequence] = []  # row i of the slot cache is _active[i]
        self._wake = threading.Condition()
        self._closed = False
        self._cache = SlotKVCache(
            model.config, max_batch_size, model.device, activation_dtype(model)
        )
        if model.device.type == "cpu":
            cpu_decode.install(model)
        self._thread = threading.Thread(target=self._run, name="decoderlm-scheduler", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        """Queue `seq`; its tokens arrive through seq.emit."""
        if seq.seed is not None:
            seq.generator = torch.Generator(device=self.model.device).manual_seed(seq.seed)
        seq.ids = list(seq.prompt)
        with self._wake:
            self._waiting.append(seq)
            self._wake.notify()

    def close(self) -> None:
        """Stop the thread (waiting and active sequences get no more tokens)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=10)

    @property
    def load(self) -> tuple[int, int]:
        """(active, waiting) sequences."""
        return len(self._active), len(self._waiting)

    def _run(self) -> None:
        with torch.no_grad():
            while True:
                with self._wake:
                    while not self._closed and not self._waiting and not self._active:
                        self._wake.wait()
                    if self._closed:
                        return
                    joining = []
                    while self._waiting and len(self._active) + len(joining) < self.max_batch_size:
                        joining.append(self._waiting.popleft())
                try:
                    self._admit(joining)
                    self._drop_finished()
                    if self._active:
                        self._decode_batch()
                        self._drop_finished()
                except Exception as e:  # a bug of ours: fail the batch, keep the thread
                    self._fail_active(e)

    def _fail_active(self, error: Exception) -> None:
        """End every active sequence with `error` and start from an empty batch."""
        for seq in self._active:
            seq.fail(error)
        self._active = []
        c = self._cache
        self._cache = SlotKVCache(self.model.config, self.max_batch_size, c.device, c.dtype)

    def _guarded(self, seq: Sequence, action) -> None:
        try:
            action(seq)
        except Exception as e:  # the request fails; the server and the other requests go on
            seq.fail(e)

    def _prefill(self, windows: list[list[int]]) -> tuple[KVCache, torch.Tensor]:
        """One forward pass over windows of ids of one length (at most max_positions): their
        cache, batch len(windows), and the logits [len(windows), V'] of the token after each."""
        dtype = activation_dtype(self.model)
        cache = KVCache(self.model.config, len(windows), self.model.device, dtype)
        idx = torch.tensor(windows, dtype=torch.long, device=self.model.device)
        positions = torch.arange(idx.size(1), device=idx.device)[None].expand_as(idx)
        logits = self.model.forward_cached(idx, cache, positions, last_only=True)
        return cache, logits[:, -1]

    def _admit(self, joining: list[Sequence]) -> None:
        """Prefill the joining sequences, those of one prompt length together, and add them to
        the batch with their first token. A failed prefill fails the sequences in it only."""
        limit = self.model.config.max_positions
        groups: dict[int, list[Sequence]] = {}
        for seq in joining:
            if not seq.cancelled:
                groups.setdefault(min(len(seq.ids), limit), []).append(seq)
        for group in groups.values():
            try:
                cache, logits = self._prefill([seq.ids[-limit:] for seq in group])
            except Exception as e:  # the requests fail; the server and the others go on
                for seq in group:
                    seq.fail(e)
                continue
            for i, seq in enumerate(group):
                self._cache.put(cache, i)
                self._active.append(seq)
                self._guarded(seq, lambda s, i=i: self._take(s, logits[i]))

    def _take(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample seq's next token from its logits [>= V] and hand it over."""
        logits = logits[: self.vocab_size].float()
        nxt = int(sample_next(logits[None], seq.temperature, seq.top_k, seq.top_p, seq.generator))
        token = Token(nxt)
        if seq.logprobs is not None:
            lp = logits.log_softmax(-1)
            top = lp.topk(min(seq.logprobs, lp.numel()))
            pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
            token = Token(nxt, float(lp[nxt]), tuple(pairs))
        seq.ids.append(nxt)
        seq.emit(token)
        if nxt == seq.stop_id or len(seq.ids) - len(seq.prompt) >= seq.max_new_tokens:
            seq.cancelled = True
            seq.emit(None)

    def _decode_batch(self) -> None:
        """One forward pass of the newest token of every active sequence, then each samples.

        A sequence whose cache is full slides first, as `generate` does: its row is rebuilt
        from the max_positions - 1 ids before its newest, which the step then adds (so the
        newest token sees the last max_positions ids)."""
        limit = self.model.config.max_positions
        full = (self._cache.lengths >= limit).nonzero().flatten().tolist()
        if full:  # every full row slides in one forward pass (their windows are one length)
            cache, _ = self._prefill([self._active[row].ids[-limit:-1] for row in full])
            for i, row in enumerate(full):
                self._cache.replace(row, cache, i)
        device = self.model.device
        last = torch.tensor([[s.ids[-1]] for s in self._active], dtype=torch.long, device=device)
        positions = self._cache.lengths[:, None].clone()
        logits = self._step(self.model, last, self._cache, positions)  # errors: _fail_active
        for row, seq in enumerate(self._active):
            if not seq.cancelled:
                self._guarded(seq, lambda s, row=row: self._take(s, logits[row, -1]))

    def _drop_finished(self) -> None:
        """Remove finished and cancelled sequences (the last row fills each gap)."""
        for row in reversed(range(len(self._active))):
            if self._active[row].cancelled:
                self._cache.remove(row)
                last = self._active.pop()
                if row < len(self._active):
                    self._active[row] = last
