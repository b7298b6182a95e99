"""A GGUF file's vocabulary (llama.cpp's tokenizer.ggml.* metadata) as an `HFTokenizer` that
gives llama.cpp's ids (`gguf_tokenizer`), built with Hugging Face's tokenizers library.

tokenizer.ggml.model "gpt2" is byte-level BPE: `tokens` (id i = token i, spelled in GPT-2's
byte-to-unicode alphabet), `merges` ("left right", best first) and `token_type` (1 normal,
2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte). `tokenizer.ggml.pre` names how
llama.cpp cuts text into pieces before the merges (llama-vocab.cpp's pre-tokenizer types):

    gpt-2                GPT-2's regex (contractions, letters, digits, other, spaces)
    smollm               every digit a piece of its own, then GPT-2's regex
    llama-bpe (llama3,   Llama 3's regex: case-insensitive contractions, a letter run with one
      llama-v3)          leading non-letter, digit runs of at most 3, newlines apart; a piece
                         that is a whole token skips the merges (ignore_merges)
    qwen2                Llama 3's regex with single digits

tokenizer.ggml.model "llama" is SentencePiece BPE with byte fallback (TinyLlama, Llama 2,
Mistral): `tokens` with `scores`, no merges (see `_sentencepiece_bpe`).

Control and unknown tokens become special added tokens (matched in text only when allowed,
as llama.cpp's parse_special); user-defined ones become added tokens that are not special
(llama.cpp matches them in any text). The other metadata: tokenizer.ggml.bos_token_id,
eos_token_id then eot_token_id and eom_token_id (the end-of-text ids), add_bos_token (when
absent, llama.cpp's default: true for llama-bpe and SentencePiece, false otherwise) and
tokenizer.chat_template.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import UserError
from .huggingface import HFTokenizer, tokenizers_package

__all__ = ["GGUF_PRE_TOKENIZERS", "gguf_tokenizer"]

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4  # gguf.TokenType


def _llama3_regex(digits: str) -> str:
    """Llama 3's split regex (its tokenizer.json), with `digits` the digit-run quantifier."""
    return (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + digits + r"| ?[^\s\p{L}"
        r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )


# pre name -> (the split regex before the byte-level step, or None for GPT-2's own;
#              digits one by one first; ignore_merges; llama.cpp's add_bos default)
GGUF_PRE_TOKENIZERS = {
    "gpt-2": (None, False, False, False),
    "smollm": (None, True, False, False),
    "llama-bpe": (_llama3_regex("{1,3}"), False, True, True),
    "llama3": (_llama3_regex("{1,3}"), False, True, True),
    "llama-v3": (_llama3_regex("{1,3}"), False, True, True),
    "qwen2": (_llama3_regex(""), False, False, False),
}
"""The tokenizer.ggml.pre names `gguf_tokenizer` reads (see the module docstring)."""


def gguf_tokenizer(metadata: Mapping[str, object], source: str = "GGUF file") -> HFTokenizer:
    """The tokenizer a GGUF file's metadata describes, giving llama.cpp's ids.

    Args:
        metadata: {key: value} of the file's metadata, values as gguf-py's
            `ReaderField.contents()` gives them (str, int, bool, lists).
        source: the file, for messages.

    Raises:
        UserError: the tokenizers package is missing, no vocabulary, a tokenizer.ggml.model
            or tokenizer.ggml.pre decoderlm does not read (the message names those it does),
            or malformed tokens / merges / ids.
    """
    tokenizers = tokenizers_package()
    model, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if model not in ("gpt2", "llama"):
        raise UserError(
            f"{source}: its tokenizer is {model!r}; decoderlm reads GGUF vocabularies of "
            f"tokenizer.ggml.model 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)"
        )
    if model == "gpt2" and pre not in GGUF_PRE_TOKENIZERS:
        raise UserError(
            f"{source}: its pre-tokenizer (tokenizer.ggml.pre) is {pre!r}; decoderlm reads "
            f"{', '.join(GGUF_PRE_TOKENIZERS)}"
        )
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise UserError(f"{source} has no vocabulary (tokenizer.ggml.tokens)")
    types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise UserError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
    if model == "gpt2":
        library = _byte_level_bpe(tokenizers, tokens, metadata, pre, source)
        add_bos = GGUF_PRE_TOKENIZERS[pre][3]
    else:
        library = _sentencepiece_bpe(tokenizers, tokens, types, metadata, source)
        add_bos = True
    typed = list(zip(tokens, types, strict=True))
    library.add_special_tokens(
        [_added(tokenizers, t, True) for t, k in typed if k in (_UNKNOWN, _CONTROL)]
    )
    library.add_tokens([_added(tokenizers, t, False) for t, k in typed if k == _USER_DEFINED])
    get = metadata.get
    eos = [get(f"tokenizer.ggml.{n}_token_id") for n in ("eos", "eot", "eom")]
    template = get("tokenizer.chat_template")
    return HFTokenizer(
        library,
        bos_token_id=get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[i for i in eos if i is not None],
        add_bos=get("tokenizer.ggml.add_bos_token", add_bos),
        chat_template=template if isinstance(template, str) else None,
    )


def _added(tokenizers, content: str, special: bool):
    """An added token matched as it is written (not normalized first)."""
    return tokenizers.AddedToken(content, special=special, normalized=False)


def _byte_level_bpe(tokenizers, tokens: list[str], metadata, pre: str, source: str):
    """The `tokenizers.Tokenizer` of a byte-level BPE vocabulary with `pre`'s splitting.

    Raises:
        UserError: merges missing, not "left right" pairs, or naming tokens not in `tokens`.
    """
    pre_tokenizers, Regex = tokenizers.pre_tokenizers, tokenizers.Regex
    merges = metadata.get("tokenizer.ggml.merges")
    pairs = [m.split(" ") for m in merges] if isinstance(merges, list) else None
    if pairs is None or any(len(p) != 2 for p in pairs):
        raise UserError(f"{source}: tokenizer.ggml.merges must be a list of 'left right' pairs")
    regex, digits, ignore_merges, _ = GGUF_PRE_TOKENIZERS[pre]
    vocab = {t: i for i, t in enumerate(tokens)}  # a repeated string keeps its last id
    try:
        bpe = tokenizers.models.BPE(vocab, [tuple(p) for p in pairs], ignore_merges=ignore_merges)
    except Exception as e:  # the library's own Exception for merges outside the vocabulary
        raise UserError(f"{source}: its merges do not fit its vocabulary ({e})") from None
    library = tokenizers.Tokenizer(bpe)
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    library.pre_tokenizer = pre_tokenizers.Sequence(steps)
    library.decoder = tokenizers.decoders.ByteLevel()
    return library


def _sentencepiece_bpe(tokenizers, tokens: list[str], types: list[int], metadata, source: str):
    """The `tokenizers.Tokenizer` of a SentencePiece BPE vocabulary as llama.cpp runs it: a
    space before the text (tokenizer.ggml.add_space_prefix, default true; again after each
    special token) and every space spelled "▁", then the pair whose joined token scores
    highest merged first (merges ranked by `tokenizer.ggml.scores`), and characters no token
    covers as their UTF-8 byte tokens <0xXX>.

    Raises:
        UserError: scores missing or not one per token.
    """
    scores = metadata.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise UserError(f"{source}: a SentencePiece vocabulary needs one score per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    pieces = {t for t, k in zip(tokens, types, strict=True) if k in (_NORMAL, _USER_DEFINED)}
    ranked = []  # (score of the joined token, left, right)
    for token in pieces:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in pieces and right in pieces:
                ranked.append((-scores[vocab[token]], vocab[token], cut, left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = next((t for t, k in zip(tokens, types, strict=True) if k == _UNKNOWN), None)
    model = tokenizers.models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    library = tokenizers.Tokenizer(model)
    normalizers, decoders = tokenizers.normalizers, tokenizers.decoders
    prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    library.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    back = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    library.decoder = decoders.Sequence(back + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return library
