"""Logprobs of a completion's choices, in the legacy completions' shape (as OpenAI and vLLM):
{"tokens", "token_logprobs", "top_logprobs", "text_offset"} for the tokens of the choice's text
(`protocol.CompletionLogprobs`).

With echo the prompt's tokens come first (the first without a logprob or top entry), and
max_tokens 0 scores the prompt only. A prompt longer than the context (block_size) is scored as
`decoderlm eval` scores a text: non-overlapping windows of block_size, the tail scored in a
last window ending at the last token (`decoderlm.evaluate.token_logprobs`).

text_offset[i] is where token i starts in the choice's text, in characters (Python str
indices, as OpenAI's API counts them); a token that starts inside a multi-byte UTF-8 character
(a GPT-2 BPE piece holding part of one) gets the offset of that character, as tiktoken's
`decode_with_offsets` defines it. `tokens[i]` is the token decoded alone (U+FFFD for an
incomplete character, as vLLM sends).
"""

from ..evaluate import token_logprobs
from .protocol import CompletionLogprobs

__all__ = ["LogprobsBuilder", "joined_logprobs", "score_prompt", "token_bytes"]


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The UTF-8 bytes token_id stands for (a GPT-2 BPE piece or a byte may hold part of a
    character; other tokens are whole characters)."""
    encoding = getattr(tokenizer, "encoding", None)  # tiktoken's, for GPT-2 BPE
    if encoding is not None:
        return encoding.decode_single_token_bytes(token_id)
    if tokenizer.kind == "byte" and token_id < 256:
        return bytes([token_id])
    return tokenizer.decode([token_id]).encode("utf-8")


def _is_continuation(byte: int) -> bool:
    """Whether a UTF-8 byte continues a character (0b10xxxxxx) rather than starting one."""
    return 0x80 <= byte < 0xC0


class LogprobsBuilder:
    """The logprobs object of one choice, built as its tokens arrive.

    Args:
        tokenizer: the served tokenizer (decodes the tokens and top entries).
        offset: the text_offset of the first token added, in characters.

    Attributes:
        offset: the characters begun so far (the next token's text_offset, see the module).
    """

    def __init__(self, tokenizer, offset: int = 0):
        self.tokenizer, self.offset = tokenizer, offset
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        self.ranked = []

    def add(self, token_id: int, logprob: float | None, top) -> None:
        """One token; top: (id, logprob) pairs, or None (no entry: the first prompt token)."""
        text = self.tokenizer.decode([token_id])
        raw = token_bytes(self.tokenizer, token_id)
        inside = bool(raw) and _is_continuation(raw[0])  # in a character begun before
        self.text_offset.append(max(self.offset - inside, 0))
        self.offset += sum(1 for b in raw if not _is_continuation(b))
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        if top is None:
            self.top_logprobs.append(None)
            self.ranked.append(None)
        else:
            top = list(top)
            entry = {self.tokenizer.decode([i]): v for i, v in top}
            entry.setdefault(text, logprob)
            self.top_logprobs.append(entry)
            alternatives = [
                (self.tokenizer.decode([i]), v, token_bytes(self.tokenizer, i)) for i, v in top
            ]
            self.ranked.append(((text, logprob, raw), alternatives))

    def take(self) -> CompletionLogprobs:
        """The entries added since the last take."""
        out = CompletionLogprobs(
            tokens=self.tokens,
            token_logprobs=self.token_logprobs,
            top_logprobs=self.top_logprobs,
            text_offset=self.text_offset,
        )
        out._ranked = self.ranked
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        self.ranked = []
        return out


def score_prompt(model, ids: list[int], k: int, out: LogprobsBuilder) -> None:
    """Add a prompt's tokens to `out`, each scored by `model` given those before it (the first
    without a logprob), with its k most likely tokens; ids of out.tokenizer's vocabulary."""
    vocab_size = out.tokenizer.vocab_size
    lp, top_v, top_i = token_logprobs(model, ids, k, vocab_size)
    out.add(ids[0], None, None)
    for j, token in enumerate(ids[1:]):
        out.add(token, float(lp[j]), zip(top_i[j].tolist(), top_v[j].tolist(), strict=True))


def joined_logprobs(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    """One logprobs object of the parts' entries, in order (empty lists for no parts)."""
    fields = CompletionLogprobs.model_fields
    out = CompletionLogprobs(**{k: [x for part in parts for x in getattr(part, k)] for k in fields})
    out._ranked = [x for part in parts for x in part._ranked]
    return out
