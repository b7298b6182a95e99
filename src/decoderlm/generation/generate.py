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
from ..model.model import eval_mode
from .params import SamplingParams
from .precision import decoding_setup
from .prefix_cache import PrefixCache
from .steps import decode_step, fixed_capacity, prefill

__all__ = [
    "generate",
    "stream_generate",
    "stream_text",
    "TextStream",
    "sample_next",
    "filter_logits",
    "end_of_text_ids",
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


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Choose the next token of each row from last-position logits.

    Args:
        logits: [B, V] float, finite.
        params: the settings used: temperature (0 picks the argmax, greedy, as do
            temperatures so small that the softmax is one-hot), top_k, top_p (see
            `filter_logits`); they were checked when params was built.
        generator: torch RNG for the draw.

    Returns:
        [B] int64 token ids.

    Raises:
        UserError: non-finite logits.
    """
    # one reduction: a NaN or inf anywhere makes the sum non-finite, and float64 cannot
    # overflow from summing float32 values
    if not math.isfinite(logits.sum(dtype=torch.float64)):
        raise UserError("the model produced non-finite logits (NaN or inf)")
    logits = logits.float()
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits / params.temperature, params.top_k, params.top_p).softmax(-1)
    if not torch.isfinite(probs).all():  # temperature so small that logits/temperature overflow
        return logits.argmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def end_of_text_ids(model, eos_token_id: int | None = None, ignore_eos: bool = False):
    """The token ids where generation stops a row by default, a tuple of ints: () with
    ignore_eos, else (eos_token_id,) when given, else the model's `eos_token_ids` (set by the
    loaders from the tokenizer: every end-of-text id it has, e.g. a Hugging Face
    generation_config.json's list) while they start with its `eos_token_id`, else that id
    alone (a caller who sets `model.eos_token_id` is obeyed); () for none.

    Raises:
        UserError: an id that is not an integer.
    """
    if ignore_eos:
        return ()
    if eos_token_id is None:
        eos_token_id = getattr(model, "eos_token_id", None)
        ids = tuple(getattr(model, "eos_token_ids", ()))  # valid while it starts with the id
        if ids[:1] == (eos_token_id,):
            return ids
    ids = () if eos_token_id is None else (eos_token_id,)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise UserError(f"eos_token_id must be a token id (an integer), got {i!r}")
    return tuple(int(i) for i in ids)


def _check_generate_args(idx, attention_mask, slide_by, limit):
    if idx.dim() != 2 or idx.size(1) == 0:
        raise UserError(f"idx must be [B, T] with T >= 1, got shape {tuple(idx.shape)}")
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


def _sample_checked(logits: torch.Tensor, step: int, params: SamplingParams, generator):
    """`sample_next` of logits [B, vocab_size], with errors naming the step: (the ids [B]
    int64, the same as a list of ints)."""
    try:
        nxt = sample_next(logits, params, generator)
    except ValueError as e:
        raise UserError(f"step {step}: {e}") from None
    chosen = nxt.tolist()
    if min(chosen) < 0 or max(chosen) >= logits.size(-1):
        raise UserError(f"step {step}: sampled token id {chosen} is outside [0, {logits.size(-1)})")
    return nxt, chosen


def _stop_sequences(model, params: SamplingParams) -> list[tuple[int, ...]]:
    """params' stop token sequences and the end-of-text tokens, as tuples of ids."""
    eos = end_of_text_ids(model, params.eos_token_id, params.ignore_eos)
    return [*params.stop_token_ids, *((i,) for i in eos)]


def _ends_with_stop(generated: list[int], stops: list[tuple[int, ...]]) -> bool:
    """Whether one row's new tokens end with one of the stop sequences (kept in Python
    lists: at each token a handful of torch calls would cost more than the comparison)."""
    return any(tuple(generated[-len(seq) :]) == seq for seq in stops)


@torch.no_grad()
def stream_generate(
    model,
    idx: torch.Tensor,
    params: SamplingParams,
    *,
    attention_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    pad_token_id: int = -1,
    slide_by: int = 1,
    prefixes: PrefixCache | None = None,
):
    """Yield the next token of every row, [B] int64, up to params.max_new_tokens times; see
    `generate` (its keywords other than the sampling settings and `prefixes` are these). Rows
    that have stopped (at a stop sequence or the end-of-text token) yield pad_token_id; the
    loop ends when all have. The model is not changed (eval mode while decoding, its mode
    restored); the one-token step is compiled when its `DecodingSetup` says so.

    prefixes: a `PrefixCache` for one unpadded row with the cache (`decoderlm chat` keeps
    one across a conversation's turns): a prompt within max_positions is prefilled from the
    entry sharing its longest prefix, its other tokens only, and once the loop ends (or the
    consumer stops it) the keys and values of the tokens fed to the model are kept there,
    unless the context slid.

    Raises:
        ValueError: prefixes with several rows, an attention_mask or use_cache=False.
    """
    limit = model.config.max_positions
    _check_generate_args(idx, attention_mask, slide_by, limit)
    if prefixes is not None and (idx.size(0) > 1 or attention_mask is not None or not use_cache):
        raise ValueError("prefixes take one row, no attention_mask, and the cache")
    if params.seed is not None:
        generator = torch.Generator(device=idx.device).manual_seed(params.seed)
    (B, T0), n = idx.shape, idx.size(1)  # n: tokens so far
    ids = idx.new_empty(B, T0 + params.max_new_tokens)  # filled as we go: no concatenation
    ids[:, :T0] = idx
    mask = None  # None: no padding, so no attention mask to build at each step
    if attention_mask is not None and not attention_mask.bool().all():
        mask = torch.ones(ids.shape, dtype=torch.bool, device=idx.device)
        mask[:, :T0] = attention_mask.to(device=idx.device, dtype=torch.bool)
    setup = decoding_setup(model)
    compiled = setup is not None and setup.compile
    one_token = decode_step(compiled)
    # a compiled step's cache: sized to the tokens it will hold (`fixed_capacity`)
    capacity = fixed_capacity(model, T0 + params.max_new_tokens) if compiled else None
    stops = _stop_sequences(model, params)
    finished, generated = [False] * B, [[] for _ in range(B)]  # per row, for the stops
    cache, positions, window = None, None, limit
    with eval_mode(model):
        try:
            for step in range(params.max_new_tokens):
                if cache is not None and cache.length >= limit:  # full: slide (see slide_by)
                    cache, window = None, limit + 1 - slide_by
                if cache is None:  # the prompt, a slid window; without use_cache, every step
                    lo = max(0, n - window)
                    past = (
                        _kept_prefix(model, prefixes, ids[0, :n], capacity) if step == 0 else None
                    )
                    lo = lo if past is None else past.length
                    cache, positions, logits = prefill(
                        model,
                        ids[:, lo:n],
                        None if mask is None else mask[:, lo:n],
                        capacity,
                        past=past,
                    )
                    cache, positions = cache if use_cache else None, positions[:, -1:]
                else:  # one new token
                    positions = positions + 1
                    key_mask = None if mask is None else mask[:, n - cache.length - 1 : n]
                    logits = one_token(model, ids[:, n - 1 : n], cache, positions, key_mask)[:, -1]
                nxt, chosen = _sample_checked(logits, step, params, generator)
                ids[:, n] = nxt
                n += 1
                if any(finished):
                    nxt = nxt.masked_fill(torch.tensor(finished, device=nxt.device), pad_token_id)
                yield nxt
                if stops:
                    for row, token in enumerate(chosen):
                        generated[row].append(token)
                        finished[row] = finished[row] or _ends_with_stop(generated[row], stops)
                    if all(finished):
                        return
        finally:
            if prefixes is not None and cache is not None and cache.length == n - 1:  # not slid
                kept = KVCache.holding(model.config, cache.k, cache.v, 0, n - 1, n - 1)
                prefixes.keep(ids[0, : n - 1].tolist(), kept)


def _kept_prefix(model, prefixes, prompt: torch.Tensor, capacity) -> KVCache | None:
    """A cache of `capacity` positions (None: max_positions + 1) holding the longest prefix of
    prompt [n] kept in prefixes, or None (no prefixes, no such prefix, or a prompt past
    max_positions)."""
    if prefixes is None or prompt.size(0) > model.config.max_positions:
        return None
    kept, p = prefixes.longest(prompt.tolist())
    if kept is None:
        return None
    capacity = model.config.max_positions + 1 if capacity is None else capacity
    return KVCache.holding(model.config, kept.k, kept.v, 0, p, capacity)


def _sampling_params(max_new_tokens, do_sample=True, stop=None, **settings) -> SamplingParams:
    """`generate`'s keywords as SamplingParams: do_sample=False is temperature 0, stop is
    stop_token_ids."""
    if "compile" in settings:
        raise TypeError(
            "generate() takes no compile: prepare the model with "
            "generation.precision.prepare_for_decoding(model, compile=True)"
        )
    if not do_sample:
        settings["temperature"] = 0.0
    return SamplingParams(max_new_tokens, stop_token_ids=stop, **settings)


_RUN_OPTIONS = ("attention_mask", "generator", "use_cache", "pad_token_id", "slide_by")


@torch.no_grad()
def generate(
    model,
    idx: torch.Tensor,
    max_new_tokens: int | None = None,
    params: SamplingParams | None = None,
    **options,
) -> torch.Tensor:
    """Extend idx by max_new_tokens tokens sampled from `model`, with a KV cache.

    One forward pass over the prompt fills the cache (a `KVCache`: per layer [B, n_kv_heads,
    max_positions + 1, head_dim]); then each new token is one forward pass of one position. When
    the sequence outgrows the config's max_positions (block_size, the trained length, unless
    a sinusoidal or rotary model allows more) the context slides: one forward pass over the
    last max_positions + 1 - slide_by tokens rebuilds the cache and gives the next logits, so
    the tokens equal those of rerunning the full forward on that window.

    The model is not changed: it runs in eval mode here (no dropout) and its mode is restored;
    it decodes as `generation.precision.prepare_for_decoding` left it (a model never prepared:
    eager, its own dtype and nn.Linear products; compile=True there compiles the one-token
    step, see `steps.decode_step`: the tokens are those of the eager step up to float
    rounding).

    Args:
        model: a DecoderLM.
        idx: [B, T] int64 prompt ids, T >= 1 (T may exceed max_positions).
        max_new_tokens: number of tokens to append, >= 0 (or give params).
        params: the `SamplingParams` (then give neither max_new_tokens nor sampling
            keywords).
        **options: keyword arguments. The sampling settings, made into a `SamplingParams`
            with max_new_tokens: temperature, top_k, top_p, seed, eos_token_id, ignore_eos
            (see `SamplingParams`); do_sample=False is greedy decoding (temperature 0); stop:
            a token id, or a list of ids and/or id sequences: a row ends once its new tokens
            end with one of them (the stop tokens are kept in the output; SamplingParams'
            stop_token_ids). And, with params or without:
        generator: a torch.Generator to draw from (ignored when a seed is given).
        attention_mask: [B, T] 1 for prompt tokens, 0 for left padding (prompts of different
            lengths in one batch); positions count real tokens only, so each row gets the
            tokens it would get alone (while the batch fits in max_positions).
        use_cache: False reruns the whole window at every step (for checking).
        pad_token_id: what a row that has stopped gets while others go on.
        slide_by: once the context is full, how many of its oldest tokens to drop at once.
            1 rebuilds the cache from the last max_positions - 1 tokens before the newest at
            every new token (the tokens of rerunning the model on the last max_positions, as
            above); k > 1 rebuilds it from the last max_positions - k and then extends it one
            token at a time until it is full again, so only every k-th token past
            max_positions costs a forward pass over the window (llama.cpp's "context
            shift"); the model then sees between max_positions + 1 - k and max_positions
            tokens. Ignored with use_cache=False.

    Returns:
        [B, T + n] int64, n = max_new_tokens, or fewer when every row has stopped (at a stop
        sequence or the end-of-text token; with eos_token_id None, the model's
        `eos_token_id` attribute, which the loaders set from the tokenizer).

    Raises:
        UserError: bad settings or prompt, non-finite logits (the message names the step), or
            a sampled id outside the vocabulary.
        TypeError: params together with max_new_tokens or sampling keywords; compile (a
            setting of `prepare_for_decoding`).
    """
    run = {k: options.pop(k) for k in _RUN_OPTIONS if k in options}
    if params is None:
        if max_new_tokens is None:
            raise TypeError("generate() needs max_new_tokens or params")
        params = _sampling_params(max_new_tokens, **options)
    elif max_new_tokens is not None or options:
        raise TypeError("give generate() params or max_new_tokens and sampling keywords, not both")
    new = list(stream_generate(model, idx, params, **run))
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
    params: SamplingParams,
    end_ids: tuple[int, ...] = (),
    prefixes: PrefixCache | None = None,
):
    """Sample one continuation and yield its text as it grows, as (delta, finish_reason).

    Text is released as `TextStream` releases it. The continuation ends before the first of
    params.stop (which is not yielded) or at the end-of-text token (params.eos_token_id, else
    the model's `eos_token_id`; its text is not yielded; params.ignore_eos runs on past it) or
    one of `end_ids` (a chat template's end-of-turn token, say; not yielded either) with
    finish_reason "stop", or after params.max_new_tokens tokens with "length". It
    decodes one row and ends at that row's end-of-text token, so generate's pad_token_id never
    reaches the text (tokenizers refuse ids outside the vocabulary, -1 included). prefixes:
    see `stream_generate`.

    Yields:
        (delta, None) while going, then one last (delta, "stop" | "length", n_new_tokens).
    """
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    text = TextStream(tokenizer, list(params.stop))
    eos = end_of_text_ids(model, params.eos_token_id, params.ignore_eos)
    for token in stream_generate(model, idx, params, prefixes=prefixes):
        if int(token[0]) in eos or int(token[0]) in end_ids:
            yield text.rest(), "stop", len(text.ids) + 1
            return
        delta = text.push(int(token[0]))
        if text.stopped:
            yield delta, "stop", len(text.ids)
            return
        if delta:
            yield delta, None
    yield text.rest(), "length", len(text.ids)
