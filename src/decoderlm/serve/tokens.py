"""The tokenizer as the API uses it: a text's token ids (special tokens' strings taken as
their ids), token ids checked against the vocabulary, a completion's prompts as token ids, and
the token served as end of text.

End of text (GET /tokenizer_info's eos_token, which lm-evaluation-harness uses as the prefix
of every document it scores and appends to its stop strings): the tokenizer's end-of-text
token (GPT-2: "<|endoftext|>" = 50256); a char or byte model trained without one reports
"\\n", its line break, so documents are scored as if they started on a new line (pass
lm-eval's `eos_string=...` to stop generations at another text).
"""

from .errors import ApiError

__all__ = ["check_token_ids", "encode", "eos_token_and_id", "prompt_token_ids"]


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of text, special tokens' strings (e.g. "<|endoftext|>") taken as their ids,
    as Hugging Face tokenizers and vLLM do. Raises UserError for unknown characters."""
    if getattr(tokenizer, "special_tokens", None):
        return tokenizer.encode(text, allowed_special="all")
    return tokenizer.encode(text)


def eos_token_and_id(tokenizer) -> tuple[str | None, int | None]:
    """(text, id) of the token served as end of text: the tokenizer's `eot_token` (and its
    special-token string), else a line break "\\n" when it is one token of the vocabulary,
    else (None, None)."""
    eot = getattr(tokenizer, "eot_token", None)
    if eot is not None:
        names = {i: s for s, i in getattr(tokenizer, "special_tokens", {}).items()}
        return names.get(eot) or tokenizer.decode([eot]), int(eot)
    try:
        ids = encode(tokenizer, "\n")
    except ValueError:
        return None, None
    return ("\n", ids[0]) if len(ids) == 1 else (None, None)


def check_token_ids(ids: list[int], vocab_size: int, param: str = "tokens") -> list[int]:
    """`ids`, checked to be in [0, vocab_size).

    Raises:
        ApiError: 400 naming the first id outside the vocabulary (param: `param`).
    """
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ApiError(
            400,
            f"{param}: token id {bad[0]} is outside this model's vocabulary [0, {vocab_size})",
            param,
        )
    return ids


def prompt_token_ids(tokenizer, prompt) -> list[tuple[list[int], str | None]]:
    """(token ids, text or None for a prompt given as ids) of each prompt of a completion
    request's `prompt` field (a text, texts, token ids or lists of token ids).

    Raises:
        ApiError: 400 for no prompt, an empty one, a text the vocabulary cannot encode or an
            id outside it.
    """
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt or not all(prompt):
        raise ApiError(400, "prompt must not be empty (nor hold an empty prompt)", "prompt")
    out = []
    for item in prompt:
        if isinstance(item, str):
            try:
                out.append((encode(tokenizer, item), item))
            except ValueError as e:
                raise ApiError(400, f"prompt: {e}", "prompt") from None
        else:
            out.append((check_token_ids(item, tokenizer.vocab_size, "prompt"), None))
    return out
