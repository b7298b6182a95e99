"""Sampling from a DecoderLM: a KV cache, temperature, top-k, top-p, greedy, seeds, left
padding, streaming.

The context slides past max_positions (block_size unless a sinusoidal or rotary model's config
allows more): the cache is rebuilt from the last max_positions tokens, so any number of new
tokens can be generated without an index error.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..errors import UserError
from ..model.kv_cache import KVCache
from . import cpu_decode
from .precision import activation_dtype

__all__ = [
    "generate",
    "stream_generate",
    "stream_text",
    "TextStream",
    "sample_next",
    "check_controls",
    "filter_logits",
    "decode_step",
    "end_of_text_id",
]


def filter_logits(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Set the logits of tokens outside the top-k / nucleus to -inf.

    Args:
        logits: [B, V] float.
        top_k: keep the k largest logits per row (None: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p
            (Holtzman et al. 2019); the most likely token is always kept, so top_p -> 0
            behaves as greedy decoding.

    Returns:
        [B, V] float, the filtered logits (a new tensor).
    """
    logits = logits.clone()
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits[logits < kth] = float("-inf")
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop_sorted[:, 0] = False
        logits[drop_sorted.scatter(1, order, drop_sorted)] = float("-inf")
    return logits


def check_controls(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise UserError for a temperature below 0 or not finite, a top_k below 1 or not an
    integer, or a top_p outside [0, 1] (None: top_k / top_p unused)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise UserError(
            f"temperature must be a finite number >= 0 (0 means greedy), got {temperature}"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise UserError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not 0.0 <= top_p <= 1.0:
        raise UserError(f"top_p must be in [0, 1] or None, got {top_p}")


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Choose the next token of each row from last-position logits.

    Args:
        logits: [B, V] float, finite.
        temperature: divide the logits by this before the softmax; 0 picks the argmax
            (greedy), as do temperatures so small that the softmax is one-hot.
        top_k, top_p: see `filter_logits`.
        generator: torch RNG for the draw.

    Returns:
        [B] int64 token ids.

    Raises:
        ValueError: temperature < 0, top_k < 1, top_p outside [0, 1], or non-finite logits.
    """
    check_controls(temperature, top_k, top_p)
    # one reduction: a NaN or inf anywhere makes the sum non-finite, and float64 cannot
    # overflow from summing float32 values
    if not math.isfinite(logits.sum(dtype=torch.float64)):
        raise UserError("the model produced non-finite logits (NaN or inf)")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits / temperature, top_k, top_p).softmax(dim=-1)
    if not torch.isfinite(probs).all():  # temperature so small that logits/temperature overflow
        return logits.argmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _stop_sequences(stop) -> list[torch.Tensor]:
    """stop: None, a token id, or a list of token ids and/or lists of token ids."""
    if stop is None:
        return []
    if isinstance(stop, torch.Tensor):
        stop = stop.tolist()
    items = [stop] if isinstance(stop, numbers.Integral) else list(stop)
    out = []
    for item in items:
        if isinstance(item, torch.Tensor):
            item = item.tolist()
        seq = [item] if isinstance(item, numbers.Integral) else list(item)
        if not seq or not all(
            isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in seq
        ):
            raise UserError(
                f"stop must hold token ids or non-empty lists of token ids, got {item!r}"
            )
        out.append(torch.tensor([int(i) for i in seq], dtype=torch.long))
    return out


def end_of_text_id(model, eos_token_id: int | None = None, ignore_eos: bool = False) -> int | None:
    """The token id where generation stops a row by default: None with ignore_eos, else
    eos_token_id when given, else the model's `eos_token_id` attribute (set by the loaders
    from the tokenizer; None for a vocabulary without an end-of-text token)."""
    if ignore_eos:
        return None
    if eos_token_id is None:
        eos_token_id = getattr(model, "eos_token_id", None)
    if eos_token_id is not None and (
        isinstance(eos_token_id, bool) or not isinstance(eos_token_id, numbers.Integral)
    ):
        raise UserError(f"eos_token_id must be a token id (an integer), got {eos_token_id!r}")
    return None if eos_token_id is None else int(eos_token_id)


def _one_token(model, idx, cache, positions, key_mask=None):
    return model.forward_cached(idx, cache, positions, key_mask, last_only=True)


_compiled_one_token = None


def decode_step(compile: bool = False):
    """The function that computes the logits of one new token per row from a KV cache, as
    `generate` and the server's `Scheduler` call it at each decoding step.

    The function returned is step(model, idx, cache, positions, key_mask=None) -> logits:
    idx [B, 1] int64 (each row's newest token), cache a `KVCache` or `SlotKVCache` holding the
    tokens before it (the new token's keys and values are appended), positions [B, 1] int64
    (the new token's position in each row), key_mask [B, L + 1] bool or None (False marks
    padding among the cached tokens and the new one; None: no padding); logits [B, 1,
    vocab_size] in the model's dtype.

    Args:
        compile: False: a plain call of model.forward_cached(idx, cache, positions, key_mask,
            last_only=True); True: the same under torch.compile,
            built on first use and shared by every caller, with dynamic shapes so that the
            growing cache does not recompile at every step (the first calls compile: seconds;
            needs a C++ compiler on the CPU).
    """
    global _compiled_one_token
    if not compile:
        return _one_token
    if _compiled_one_token is None:
        _compiled_one_token = torch.compile(_one_token, dynamic=True)
    return _compiled_one_token


def _check_generate_args(idx, max_new_tokens, attention_mask, slide_by=1, limit=1):
    if idx.dim() != 2 or idx.size(1) == 0:
        raise UserError(f"idx must be [B, T] with T >= 1, got shape {tuple(idx.shape)}")
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if isinstance(slide_by, bool) or not isinstance(slide_by, int) or not 1 <= slide_by <= limit:
        raise UserError(f"slide_by must be an integer in [1, {limit}], got {slide_by!r}")
    if attention_mask is not None:
        if attention_mask.shape != idx.shape:
            raise UserError(
                f"attention_mask must have idx's shape {tuple(idx.shape)}, got "
                f"{tuple(attention_mask.shape)}"
            )
        if not attention_mask.bool()[:, -1].all():
            raise UserError(
                "prompts must be left-padded: the last column of attention_mask must be all ones"
            )


def _prefill(model, ids: torch.Tensor, n: int, mask: torch.Tensor | None, dtype, keep: int):
    """A new KVCache filled from the last `keep` (<= max_positions) of ids[:, :n]: (cache,
    positions [B, T] of those tokens, logits [B, 1, vocab_size] of the last one). Positions
    count real tokens only when `mask` marks padding."""
    B, lo = ids.size(0), max(0, n - keep)
    window_mask = None if mask is None else mask[:, lo:n]
    if window_mask is None:
        positions = torch.arange(n - lo, device=ids.device).expand(B, -1)
    else:
        positions = (window_mask.long().cumsum(1) - 1).clamp(min=0)
    cache = KVCache(model.config, B, ids.device, dtype)
    logits = model.forward_cached(ids[:, lo:n], cache, positions, window_mask, last_only=True)
    return cache, positions, logits


def _sample_checked(logits: torch.Tensor, step: int, temperature, top_k, top_p, generator):
    """`sample_next` of logits [B, vocab_size], with errors naming the step."""
    try:
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
    except ValueError as e:
        raise UserError(f"step {step}: {e}") from None
    chosen = nxt.tolist()
    if min(chosen) < 0 or max(chosen) >= logits.size(-1):
        raise UserError(f"step {step}: sampled token id {chosen} is outside [0, {logits.size(-1)})")
    return nxt


def _ends_with_stop(generated: torch.Tensor, stops: list[torch.Tensor]) -> torch.Tensor:
    """[B] bool: whether each row of generated [B, n] ends with one of the stop sequences."""
    done = torch.zeros(generated.size(0), dtype=torch.bool, device=generated.device)
    for seq in stops:
        if generated.size(1) >= len(seq):
            done |= (generated[:, -len(seq) :] == seq.to(generated.device)).all(1)
    return done


@torch.no_grad()
def stream_generate(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    do_sample: bool = True,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    use_cache: bool = True,
    stop=None,
    pad_token_id: int = -1,
    compile: bool = False,
    slide_by: int = 1,
    eos_token_id: int | None = None,
    ignore_eos: bool = False,
):
    """Yield the next token of every row, [B] int64, up to max_new_tokens times; see
    `generate`. Rows that have stopped (at a stop sequence or the end-of-text token) yield
    pad_token_id; the loop ends when all have."""
    limit = model.config.max_positions
    check_controls(temperature, top_k, top_p)
    _check_generate_args(idx, max_new_tokens, attention_mask, slide_by, limit)
    if not do_sample:
        temperature = 0.0
    if seed is not None:
        generator = torch.Generator(device=idx.device).manual_seed(seed)
    (B, T0), n = idx.shape, idx.size(1)  # n: tokens so far
    ids = idx.new_empty(B, T0 + max_new_tokens)  # filled as we go: no concatenation per token
    ids[:, :T0] = idx
    mask = None  # None: no padding, so no attention mask to build at each step
    if attention_mask is not None and not attention_mask.bool().all():
        mask = torch.ones(ids.shape, dtype=torch.bool, device=idx.device)
        mask[:, :T0] = attention_mask.to(device=idx.device, dtype=torch.bool)
    dtype = activation_dtype(model)  # the KV cache's
    if model.device.type == "cpu":
        cpu_decode.install(model)
    was_training = model.training
    model.eval()
    stops = _stop_sequences(stop)
    eos = end_of_text_id(model, eos_token_id, ignore_eos)
    if eos is not None:
        stops.append(torch.tensor([eos], dtype=torch.long))
    finished = torch.zeros(B, dtype=torch.bool, device=idx.device)
    cache, positions, one_token = None, None, decode_step(compile)
    try:
        for step in range(max_new_tokens):
            if cache is not None and cache.length < limit:  # one new token
                positions = positions[:, -1:] + 1
                key_mask = None if mask is None else mask[:, n - cache.length - 1 : n]
                logits = one_token(model, ids[:, n - 1 : n], cache, positions, key_mask)
            else:  # prefill: the prompt, or a rebuild of the last tokens (see slide_by)
                keep = limit if cache is None else limit + 1 - slide_by
                cache, positions, logits = _prefill(model, ids, n, mask, dtype, keep)
                if not use_cache:
                    cache = None
            nxt = _sample_checked(logits[:, -1, :], step, temperature, top_k, top_p, generator)
            ids[:, n] = nxt
            n += 1
            yield torch.where(finished, torch.full_like(nxt, pad_token_id), nxt) if stops else nxt
            if stops:
                finished |= _ends_with_stop(ids[:, T0:n], stops)
                if finished.all():
                    return
    finally:
        model.train(was_training)


@torch.no_grad()
def generate(model, idx: torch.Tensor, max_new_tokens: int, **options) -> torch.Tensor:
    """Extend idx by max_new_tokens tokens sampled from `model`, with a KV cache.

    One forward pass over the prompt fills the cache (a `KVCache`: per layer [B, n_heads,
    max_positions + 1, head_dim]); then each new token is one forward pass of one position. When
    the sequence outgrows the config's max_positions (block_size, the trained length, unless
    a sinusoidal or rotary model allows more) the context slides: the cache is rebuilt from
    the last max_positions tokens, so the tokens equal those of rerunning the full forward on
    the last max_positions tokens.

    Args:
        model: a DecoderLM; it runs in eval mode here (no dropout) and its mode is restored.
        idx: [B, T] int64 prompt ids, T >= 1 (T may exceed max_positions).
        max_new_tokens: number of tokens to append, >= 0.
        **options: keyword arguments, passed on to `stream_generate`:
        temperature, top_k, top_p: see `sample_next`; do_sample=False is greedy decoding.
        seed: seeds a fresh torch.Generator so the same call gives the same tokens.
        generator: a torch.Generator to draw from instead (ignored when seed is given).
        attention_mask: [B, T] 1 for prompt tokens, 0 for left padding (prompts of different
            lengths in one batch); positions count real tokens only, so each row gets the
            tokens it would get alone (while the batch fits in max_positions).
        use_cache: False reruns the whole window at every step (for checking).
        stop: a token id, or a list of ids and/or id sequences: a row ends once its new
            tokens end with one of them (the stop tokens are kept in the output).
        eos_token_id: the end-of-text token id: a row ends once it samples it (kept in the
            output, like a stop token). None: the model's `eos_token_id` attribute, which
            the loaders set from the tokenizer (`decoderlm.io.load`,
            `DecoderLM.from_pretrained`, `decoderlm.io.hf_gpt2.load_gpt2`: 50256 for GPT-2
            BPE); a model built from a ModelConfig has none, so it runs on.
        ignore_eos: True runs on past the end-of-text token (vLLM's name): exactly
            max_new_tokens tokens unless a `stop` sequence ends every row.
        pad_token_id: what a row that has stopped gets while others go on.
        slide_by: once the context is full, how many of its oldest tokens to drop at once.
            1 rebuilds the cache from the last max_positions tokens at every new token (the
            tokens of rerunning the model on them, as above); k > 1 rebuilds it from the last
            max_positions + 1 - k tokens and then extends it one token at a time until it is
            full again, so only every k-th token past max_positions costs a forward pass over
            the window (llama.cpp's "context shift"); the model then sees between
            max_positions + 1 - k and max_positions tokens. Ignored with use_cache=False.
        compile: run each one-token step under torch.compile (needs a C++ compiler on the
            CPU). The first call compiles; later ones decode faster (benchmarks/README.md gives
            figures). The tokens are those of compile=False up to float rounding (the
            products accumulate in another order). The compiled step is shared by every
            model of the process; torch keeps 8 variants of it (a model's dtype, batch of
            one or more, with or without padding) and runs further ones eagerly (torch logs
            "hit config.recompile_limit").

    Returns:
        [B, T + n] int64, n = max_new_tokens, or fewer when every row has stopped (at a stop
        sequence or the end-of-text token).

    Raises:
        ValueError: bad controls or prompt, non-finite logits (the message names the step), or
            a sampled id outside the vocabulary.
    """
    new = list(stream_generate(model, idx, max_new_tokens, **options))
    return torch.cat([idx, torch.stack(new, dim=1)], dim=1) if new else idx.clone()


class TextStream:
    """The text of a growing continuation, released as it becomes final.

    push(token_id) adds one token and returns the text that can be shown now; text is held
    back while it ends in an incomplete character (U+FFFD from a partial UTF-8 byte sequence)
    or could be the start of a stop text. Once the text holds a stop text, `stopped` is True
    and the text before the first stop text is all that is ever released (the stop text
    itself never is). `rest()` releases what is held back at the end.

    Args:
        tokenizer: decodes the tokens.
        stop: stop texts (empty ones are ignored).
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer, self.stop = tokenizer, [s for s in stop or [] if s]
        self.ids: list[int] = []
        self.shown, self.text, self.stopped = "", "", False

    def push(self, token_id: int) -> str:
        """Add a token; returns the newly final text ("" while held back)."""
        self.ids.append(int(token_id))
        self.text = text = self.tokenizer.decode(self.ids)
        cut = min((text.find(s) for s in self.stop if s in text), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(text[:cut])
        hold = max(
            (k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0
        )
        safe = text[: len(text) - hold]
        return "" if safe.endswith("\ufffd") else self._release(safe)

    def rest(self) -> str:
        """The text held back, released at the end (none after a stop text)."""
        return "" if self.stopped else self._release(self.text)

    def _release(self, upto: str) -> str:
        delta = upto[len(self.shown) :] if len(upto) > len(self.shown) else ""
        self.shown += delta
        return delta


def stream_text(
    model,
    tokenizer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    compile: bool = False,
    ignore_eos: bool = False,
):
    """Sample one continuation and yield its text as it grows, as (delta, finish_reason).

    Text is released as `TextStream` releases it. The continuation ends before the
    first stop text (which is not yielded) or at the model's end-of-text token (see
    `generate`'s eos_token_id; its text is not yielded; ignore_eos=True runs on past it) with
    finish_reason "stop", or after max_new_tokens tokens with "length". It decodes one row and
    ends at that row's end-of-text token, so generate's pad_token_id never reaches the text
    (tokenizers refuse ids outside the vocabulary, -1 included).

    Yields:
        (delta, None) while going, then one last (delta, "stop" | "length", n_new_tokens).
    """
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    text, eos = TextStream(tokenizer, stop), end_of_text_id(model, ignore_eos=ignore_eos)
    tokens = stream_generate(
        model,
        idx,
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        seed=seed,
        compile=compile,
        ignore_eos=ignore_eos,
    )
    for token in tokens:
        if int(token[0]) == eos:
            yield text.rest(), "stop", len(text.ids) + 1
            return
        delta = text.push(int(token[0]))
        if text.stopped:
            yield delta, "stop", len(text.ids)
            return
        if delta:
            yield delta, None
    yield text.rest(), "length", len(text.ids)
