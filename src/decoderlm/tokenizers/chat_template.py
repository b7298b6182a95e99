"""Chat templates: a conversation rendered into a prompt's token ids as transformers'
`apply_chat_template` renders it (`ChatTemplate`).

A template is Jinja source code from the model (an HFTokenizer's `chat_template`: a Hugging
Face directory's `chat_template.jinja` or tokenizer_config.json's `chat_template`, a GGUF
file's `tokenizer.chat_template`) or from a file (`decoderlm serve/chat --chat-template FILE`).
It is rendered as transformers renders it: jinja2's `ImmutableSandboxedEnvironment` with
trim_blocks, lstrip_blocks and the loop-controls extension; a `tojson` filter that does not
escape HTML or non-ASCII characters; the globals `raise_exception(message)` and
`strftime_now(format)`; the variables `messages`, `add_generation_prompt` and the special
tokens' strings (`bos_token`, `eos_token`). The text is tokenized with every special token's
string as its id and nothing added (transformers' `add_special_tokens=False`).

A reply ends at the template's end-of-turn token (ChatML's `<|im_end|>`, Llama 3's
`<|eot_id|>`: the special token the template writes right after an assistant message) or at
one of the tokenizer's end-of-text ids (`ChatTemplate.end_ids`).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

from ..errors import UserError
from ..files import read_text
from .base import Tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "chat_template_of"]

_MARK = "\u2063decoderlm-end-of-turn\u2063"  # an assistant message's content, to find what follows


class ChatTemplateError(UserError):
    """The template failed to render a conversation (raise_exception, a Jinja error)."""


@functools.lru_cache(maxsize=8)
def _compiled(source: str):
    """The jinja2 template of `source`, in transformers' sandboxed environment."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        message = f"the chat template does not compile: {e} (line {e.lineno})"
        raise ChatTemplateError(message) from None


class ChatTemplate:
    """A model's chat template with its tokenizer.

    Args:
        source: the Jinja source code.
        tokenizer: the model's tokenizer (its `bos_token_id`, `eos_token_ids` where it has
            them, else `eot_token`, give the special-token variables and the end ids).

    Raises:
        ChatTemplateError: the source does not compile.
    """

    def __init__(self, source: str, tokenizer: Tokenizer):
        self.source, self.tokenizer = source, tokenizer
        self._template = _compiled(source)
        eos = tuple(getattr(tokenizer, "eos_token_ids", ()))
        eos = eos or ((tokenizer.eot_token,) if tokenizer.eot_token is not None else ())
        bos = getattr(tokenizer, "bos_token_id", None)
        self.variables = {
            "bos_token": tokenizer.decode([bos]) if bos is not None else "",
            "eos_token": tokenizer.decode([eos[0]]) if eos else "",
        }
        turn = self._end_of_turn_id()
        self.end_ids: tuple[int, ...] = tuple(
            dict.fromkeys((*eos, *(() if turn is None else (turn,))))
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The text of a conversation: `messages` ({"role", "content"} dicts) as the template
        writes them, with the start of the assistant's reply when `add_generation_prompt`.

        Raises:
            ChatTemplateError: the template raised (its message) or failed to render.
        """
        import jinja2

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.variables
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None

    def encode(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of `render(messages, add_generation_prompt)`: special tokens' strings
        as their ids, no BOS or EOS added (transformers' apply_chat_template(...,
        tokenize=True)).

        Raises:
            ChatTemplateError: as `render`.
        """
        text = self.render(messages, add_generation_prompt)
        return self.tokenizer.encode(text, allowed_special="all")

    def _end_of_turn_id(self) -> int | None:
        """The special token the template writes right after an assistant message's content
        (None: none, or the template cannot render the probe conversation)."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]
        try:
            text = self.render(probe, add_generation_prompt=False)
        except ChatTemplateError:
            return None
        after = text.split(_MARK, 1)[1] if _MARK in text else ""
        special = self.tokenizer.special_tokens
        for string, i in sorted(special.items(), key=lambda kv: -len(kv[0])):
            if after.startswith(string):
                return i
        return None


def chat_template_of(tokenizer: Tokenizer, path: str | None = None) -> ChatTemplate | None:
    """The chat template of a model: the file `path` when given, else the tokenizer's own
    (`chat_template` of an HFTokenizer), else None (the model has none).

    Raises:
        MissingFileError / UserError: `path` is missing or not UTF-8.
        ChatTemplateError: the template does not compile.
    """
    source = (
        read_text(path, "--chat-template") if path else getattr(tokenizer, "chat_template", None)
    )
    return ChatTemplate(source, tokenizer) if source else None
