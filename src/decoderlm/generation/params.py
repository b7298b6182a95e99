"""The settings of one continuation, as every decoding path takes them: `SamplingParams`.

`generate`, `stream_generate`, `stream_text`, the server's `Scheduler` sequences and the
`decoderlm sample` and `chat` commands all decode from one `SamplingParams` (vLLM's name and
shape); the server's request body converts itself
(`serve.protocol.CompletionRequest.to_sampling_params`), the commands' flags through
`from_flags`.
The settings are checked once, when the object is built, so a bad one is one line
(`UserError`) before anything is decoded. Importing this module imports no torch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ..errors import UserError, flag_name

__all__ = ["SamplingParams", "from_flags"]


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_list(value):
    """A torch tensor or numpy array as a Python list (or int); anything else as it is."""
    return value.tolist() if hasattr(value, "tolist") else value


def _token_sequences(stop) -> tuple[tuple[int, ...], ...]:
    """stop: None, a token id, or a list of token ids and/or lists of token ids (tensors
    accepted) -> a tuple of non-empty id tuples."""
    if stop is None:
        return ()
    stop = _as_list(stop)
    items = [stop] if _is_int(stop) else list(stop)
    out = []
    for item in items:
        item = _as_list(item)
        seq = [item] if _is_int(item) else list(item) if isinstance(item, list | tuple) else None
        if not seq or not all(_is_int(i) for i in seq):
            raise UserError(
                f"stop must hold token ids or non-empty lists of token ids, got {item!r}"
            )
        out.append(tuple(int(i) for i in seq))
    return tuple(out)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one continuation (frozen; checked when built).

    Attributes:
        max_new_tokens: the most tokens to generate, >= 0 (OpenAI's and vLLM's max_tokens).
        temperature: divide the logits by this before the softmax; 0 is greedy decoding (the
            argmax), as are temperatures so small that the softmax is one-hot. Finite, >= 0.
        top_k: sample among the k most likely tokens, k >= 1 (None: all).
        top_p: sample among the smallest set of most likely tokens whose probability reaches
            top_p, in [0, 1] (Holtzman et al. 2019; the most likely token is always kept, so
            top_p -> 0 is greedy; None: all).
        seed: seeds a fresh torch.Generator, so the same settings give the same tokens (None:
            the generator the caller gives, else torch's global RNG).
        stop: stop texts: the text of a continuation ends before the first one (`stream_text`,
            the server); a str is one text, empty ones are ignored. Stored as a tuple.
        stop_token_ids: token id sequences: a row ends once its new tokens end with one of
            them (kept in the output; `generate`'s `stop`). Accepts a token id, or a list of
            ids and/or id sequences (tensors too); stored as a tuple of id tuples.
        eos_token_id: the end-of-text token id: a row ends once it samples it (kept in
            `generate`'s output, not in a text). None: the model's `eos_token_id` attribute,
            which the loaders set from the tokenizer (a model built from a ModelConfig has
            none, so it runs on).
        ignore_eos: run on past the end-of-text token (vLLM's name).
        logprobs: None, or k >= 0: the server's sequences compute each token's
            log-probability and its k most likely alternatives.

    Raises:
        UserError: a setting outside the ranges above (one line naming it and the value).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    eos_token_id: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise UserError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        t = self.temperature
        if not (isinstance(t, numbers.Real) and math.isfinite(t) and t >= 0):
            raise UserError(f"temperature must be a finite number >= 0 (0 means greedy), got {t}")
        if self.top_k is not None and not (_is_int(self.top_k) and self.top_k >= 1):
            raise UserError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        p = self.top_p
        if p is not None and not (isinstance(p, numbers.Real) and 0.0 <= p <= 1.0):
            raise UserError(f"top_p must be in [0, 1] or None, got {p}")
        if self.seed is not None and not _is_int(self.seed):
            raise UserError(f"seed must be an integer or None, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) for s in stop):
            raise UserError(f"stop texts must be strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", _token_sequences(self.stop_token_ids))
        if self.eos_token_id is not None and not _is_int(self.eos_token_id):
            raise UserError(
                f"eos_token_id must be a token id (an integer), got {self.eos_token_id!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise UserError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and self.logprobs >= 0):
            raise UserError(f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}")


def from_flags(**settings) -> SamplingParams:
    """SamplingParams(**settings) built from a command's flags (`decoderlm sample`, `chat`):
    a bad setting's message names its flag (--temperature, --top-k), not its field, and
    the flags' word for None (none).

    Raises:
        UserError: as SamplingParams, the message starting with the flag.
    """
    try:
        return SamplingParams(**settings)
    except UserError as e:
        field, _, rest = str(e).partition(" ")
        if field not in settings:
            raise
        raise UserError(f"{flag_name(field)} {rest.replace(' or None', ' or none')}") from None
