"""Continuous batching: one thread decodes every active sequence of a server together.

A `Scheduler` owns the model's decoding. Requests `submit` a `Sequence` (prompt ids and a
`SamplingParams`: sampling settings, seed, how many tokens); between forward passes the
scheduler admits waiting sequences (up to max_batch_size at once; the rest queue in arrival
order) and drops finished or cancelled ones. Admitted sequences are prefilled (one forward
pass over the prompts of each length, into a `KVCache`, `steps.prefill`) and then join the
`SlotKVCache`; a prompt that starts with the tokens of a sequence that left the batch (the
same chat template and system message, a conversation's earlier turns) is prefilled from that
sequence's kept keys and values (`prefix_cache.PrefixCache`), its new tokens only. Each step
is one forward pass of one new token for every active sequence, each at its own position, and
each sequence then samples with its own temperature, top-k, top-p and torch.Generator. A
greedy sequence therefore gets the tokens it would get alone (up to float rounding of the
batched products). Past max_positions the context slides as in `generate` (`steps.slide`):
the sequence's cache is rebuilt from the max_positions - 1 tokens before its newest (the rows
sliding at one step in one forward pass). The scheduler does not change the model: it decodes
as `precision.prepare_for_decoding` left it, compiled when its `DecodingSetup` says so.

All of a server's torch work belongs on the scheduler's thread (`Scheduler.call` runs other
work there, between forward passes; the scheduler makes its cache there too): with torch's
OpenMP runtime (libgomp), a second thread's team of OpenMP threads, the one that loaded the
model say, makes the threads of every team stop spinning between parallel regions almost at
once (more OpenMP threads than cores) and sleep instead, and each decoding step then took
several times longer on 2 cores (benchmarks/README.md, "The server's compiled step").

Tokens go back through each sequence's `emit` callback as `Token`s, then None at the end (or
the exception that ended it); a sequence ends after emitting its end-of-text token (`stop_ids`:
params.eos_token_id, else the model's `eos_token_id`; none with params.ignore_eos). Stop texts
are the caller's business: it calls `cancel` and the sequence leaves the batch before the next
step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..model.kv_cache import KVCache, SlotKVCache
from .generate import end_of_text_ids, sample_next
from .params import SamplingParams
from .precision import activation_dtype, decoding_setup
from .prefix_cache import PrefixCache
from .steps import decode_step, prefill, slide

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
        params: the sampling settings: max_new_tokens (at least one token is generated),
            temperature, top_k, top_p, seed (this sequence's own torch.Generator; None: the
            global RNG), logprobs (None, or k >= 0: each token's log-probability and its top
            k), eos_token_id / ignore_eos (see `stop_ids`). Its stop texts and stop_token_ids
            are the caller's business.
        emit: called from the scheduler's thread with each `Token`, then None once done, or
            an Exception that ended the sequence.
        stop_ids: set by `Scheduler.submit`: the end-of-text token ids that end the sequence
            (the one sampled is emitted, then None; (): none), `generate.end_of_text_ids` of
            the model and params.
        cached_tokens: set as it joins the batch (before its first token is emitted): the
            prompt's leading tokens whose keys and values came from a kept sequence
            (`PrefixCache`), not prefilled again; 0 when none did.
    """

    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Token | Exception | None], None]
    stop_ids: tuple[int, ...] = field(default=(), init=False)
    ids: list[int] = field(default_factory=list, init=False)  # prompt + generated so far
    generator: torch.Generator | None = field(default=None, init=False)
    cancelled: bool = field(default=False, init=False)
    cached_tokens: int = field(default=0, init=False)

    def cancel(self) -> None:
        """Ask for no more tokens: the sequence leaves the batch before the next step."""
        self.cancelled = True

    def fail(self, error: Exception) -> None:
        """End the sequence with `error` (emitted in place of the next token)."""
        self.cancelled = True
        self.emit(error)


def _run_call(future: concurrent.futures.Future, fn: Callable, args: tuple) -> None:
    """fn(*args) into future (`Scheduler.call`), unless the future was cancelled."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # the caller's to raise, where it waits for the result
        future.set_exception(e)


class Scheduler:
    """The decoding thread of a model served to concurrent requests.

    Args:
        model: the DecoderLM (eval mode).
        vocab_size: only ids below it are sampled or scored (the tokenizer's ids, when the
            model has logits for more).
        max_batch_size: the most sequences decoded together; more wait in a queue.
        step: the function computing one new token's logits, (model, idx [B, 1] int64,
            cache, positions [B, 1] int64) -> [B, 1, vocab_size]; default: `decode_step`'s,
            compiled when the model's `DecodingSetup` says so.
        prefixes: the most finished sequences whose keys and values are kept for prompts
            that start with their tokens (`PrefixCache`); None: max_batch_size; 0: none.
    """

    def __init__(self, model, vocab_size: int, max_batch_size: int = 8, step=None, prefixes=None):
        self.model, self.vocab_size, self.max_batch_size = model, vocab_size, max_batch_size
        self._prefixes = PrefixCache(max_batch_size if prefixes is None else prefixes)
        setup = decoding_setup(model)
        self._compiled = step is None and setup is not None and setup.compile
        self._step = step or decode_step(self._compiled)
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._calls: list[tuple[concurrent.futures.Future, Callable, tuple]] = []
        self._active: list[Sequence] = []  # row i of the slot cache is _active[i]
        self._wake = threading.Condition()
        self._closed = False
        self._cache: SlotKVCache  # made on the scheduler's thread (`_new_cache`)
        self._thread = threading.Thread(target=self._run, name="decoderlm-scheduler", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        """Queue `seq`; its tokens arrive through seq.emit."""
        p = seq.params
        if p.seed is not None:
            seq.generator = torch.Generator(device=self.model.device).manual_seed(p.seed)
        seq.stop_ids = end_of_text_ids(self.model, p.eos_token_id, p.ignore_eos)
        seq.ids = list(seq.prompt)
        with self._wake:
            self._waiting.append(seq)
            self._wake.notify()

    def call(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Run fn(*args) on the scheduler's thread, between two forward passes and under
        torch.no_grad (the module docstring says why there); the Future returned gets its
        result or the exception it raised, or is cancelled if the scheduler closes first."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            self._calls.append((future, fn, args))
            self._wake.notify()
        return future

    def close(self) -> None:
        """Stop the thread (waiting and active sequences get no more tokens, calls not yet
        run are cancelled)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=10)
        for future, _, _ in self._calls:
            future.cancel()

    @property
    def load(self) -> tuple[int, int]:
        """(active, waiting) sequences."""
        return len(self._active), len(self._waiting)

    def _new_cache(self) -> None:
        """An empty `SlotKVCache` (zeroing its buffers is parallel torch work: the module
        docstring says why it belongs on this thread)."""
        m, rows = self.model, 2 if self._compiled else 1  # see SlotKVCache's rows
        dtype = activation_dtype(m)
        self._cache = SlotKVCache(m.config, self.max_batch_size, m.device, dtype, rows)

    def _run(self) -> None:
        with torch.no_grad():
            self._new_cache()
            while True:
                with self._wake:
                    while not (self._closed or self._waiting or self._active or self._calls):
                        self._wake.wait()
                    if self._closed:
                        return
                    joining = []
                    while self._waiting and len(self._active) + len(joining) < self.max_batch_size:
                        joining.append(self._waiting.popleft())
                    calls, self._calls = self._calls, []
                for future, fn, args in calls:
                    _run_call(future, fn, args)
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
        self._new_cache()

    def _guarded(self, seq: Sequence, action) -> None:
        try:
            action(seq)
        except Exception as e:  # the request fails; the server and the other requests go on
            seq.fail(e)

    def _ids(self, windows: list[list[int]]) -> torch.Tensor:
        """Windows of ids of one length as [len(windows), length] int64 on the model's device."""
        return torch.tensor(windows, dtype=torch.long, device=self.model.device)

    def _admit(self, joining: list[Sequence]) -> None:
        """Prefill the joining sequences and add them to the batch with their first token.
        A prompt that starts with a kept sequence's tokens (`PrefixCache.longest`, for prompts
        within max_positions) is prefilled from its keys and values, its other tokens only;
        the prompts of one length (and one kept prefix) are prefilled together. A failed
        prefill fails the sequences in it only."""
        limit = self.model.config.max_positions
        groups: dict[tuple[int, int, int], tuple[KVCache | None, list[Sequence]]] = {}
        for seq in joining:
            if not seq.cancelled:
                kept, p = self._prefixes.longest(seq.ids) if len(seq.ids) <= limit else (None, 0)
                key = (min(len(seq.ids), limit), p, id(kept))
                groups.setdefault(key, (kept, []))[1].append(seq)
        for (length, p, _), (kept, group) in groups.items():
            try:
                past = None
                if kept is not None:
                    c = self.model.config
                    past = KVCache.holding(c, kept.k, kept.v, 0, p, length, len(group))
                ids = self._ids([s.ids[-limit:][p:] for s in group])
                cache, _, logits = prefill(self.model, ids, capacity=length, past=past)
            except Exception as e:  # the requests fail; the server and the others go on
                for seq in group:
                    seq.fail(e)
                continue
            for i, seq in enumerate(group):
                seq.cached_tokens = p
                self._cache.put(cache, i)
                self._active.append(seq)
                self._guarded(seq, lambda s, i=i: self._take(s, logits[i]))

    def _take(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample seq's next token from its logits [>= V] and hand it over."""
        logits = logits[: self.vocab_size].float()
        p = seq.params
        nxt = int(sample_next(logits[None], p, seq.generator))
        token = Token(nxt)
        if p.logprobs is not None:
            lp = logits.log_softmax(-1)
            top = lp.topk(min(p.logprobs, lp.numel()))
            pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
            token = Token(nxt, float(lp[nxt]), tuple(pairs))
        seq.ids.append(nxt)
        seq.emit(token)
        if nxt in seq.stop_ids or len(seq.ids) - len(seq.prompt) >= p.max_new_tokens:
            seq.cancelled = True
            seq.emit(None)

    def _decode_batch(self) -> None:
        """One forward pass of the newest token of every active sequence, then each samples.

        A sequence whose cache is full slides first, as `generate` does (`steps.slide`): its
        row is rebuilt from the max_positions - 1 ids before its newest, which the step then
        adds (so the newest token sees the last max_positions ids)."""
        limit = self.model.config.max_positions
        full = (self._cache.lengths >= limit).nonzero().flatten().tolist()
        if full:  # every full row slides in one forward pass (their windows are one length)
            ids = self._ids([self._active[row].ids[-limit:] for row in full])
            cache, _ = slide(self.model, ids, limit)
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
        """Remove finished and cancelled sequences (the last row fills each gap), keeping the
        keys and values of those whose row holds all their tokens but the newest (a row that
        slid, or whose prompt was cut to max_positions, holds others) for later prompts
        (`PrefixCache`)."""
        for row in reversed(range(len(self._active))):
            seq = self._active[row]
            if seq.cancelled:
                if int(self._cache.lengths[row]) == len(seq.ids) - 1:
                    self._prefixes.keep(seq.ids[:-1], self._cache.row(row))
                self._cache.remove(row)
                last = self._active.pop()
                if row < len(self._active):
                    self._active[row] = last
