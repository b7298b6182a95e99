"""`decoderlm chat`: a conversation with a model in the terminal, rendered with its chat
template (`decoderlm.tokenizers.chat_template`)."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Annotated

from ..arguments import Fields, NonNegativeInt, PositiveInt
from ..errors import UserError
from ..options import Decoding, ModelSource
from ..tokenizers.chat_template import ChatTemplate, chat_template_of
from .generate import stream_text
from .loading import load_for_decoding
from .params import from_flags
from .prefix_cache import PrefixCache

__all__ = ["chat", "Conversation"]

HELP = (
    "/reset: start again; /system TEXT: set the system message (/system alone: none); "
    "/help: the commands; Ctrl-C: stop a reply; /exit or Ctrl-D: end"
)
COMMANDS = "/reset, /system TEXT, /help and /exit"


class Conversation:
    """The messages of a chat, kept within the model's context.

    Args:
        template: the model's chat template.
        context: the most tokens of a prompt plus its reply (the model's positions).
        reply_tokens: the tokens kept free for the reply.
        system: the system message, or None.
    """

    def __init__(self, template: ChatTemplate, context: int, reply_tokens: int, system=None):
        self.template, self.context, self.reply_tokens = template, context, reply_tokens
        self.system, self.turns = system, []

    def messages(self) -> list[dict]:
        """The system message (if any) and the turns, as the template takes them."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def prompt(self, user_text: str) -> list[int]:
        """The ids of the conversation with the user's new message, its oldest turns dropped
        until prompt + reply_tokens fit the context (the new message is added to the turns).

        Raises:
            UserError: the new message alone does not fit (the turns are left as they were).
            ChatTemplateError: the template fails on the conversation.
        """
        before = list(self.turns)
        self.turns.append({"role": "user", "content": user_text})
        while True:
            ids = self.template.encode(self.messages())
            if len(ids) + self.reply_tokens <= self.context or len(self.turns) == 1:
                break
            del self.turns[: 2 if len(self.turns) > 2 else 1]  # the oldest exchange
        if len(ids) + self.reply_tokens > self.context:
            self.turns = before
            raise UserError(
                f"the message is {len(ids)} tokens with the template; with {self.reply_tokens} "
                f"for the reply that is over the context of {self.context}: send a shorter one "
                f"(or a smaller --max-new-tokens)"
            )
        return ids


def chat(
    source: Annotated[ModelSource, Fields(ModelSource)] = ModelSource(),
    chat_template: str | None = None,
    system: str | None = None,
    max_new_tokens: PositiveInt = 512,
    temperature: float = 1.0,
    top_k: PositiveInt | None = None,
    top_p: float | None = None,
    seed: NonNegativeInt | None = None,
    decoding: Annotated[Decoding, Fields(Decoding)] = Decoding(),
) -> int:
    """Talk with a model in the terminal.

    Each message is rendered with the model's chat template together with the conversation
    so far (the oldest turns dropped when it would not fit the context) and the reply is
    streamed until the template's end-of-turn token or the end-of-text token. The keys and
    values of the last prompt and reply are kept: a prompt is prefilled from where it
    leaves them (its new message, mostly; `prefix_cache.PrefixCache`). In the
    conversation: /reset starts again, /system TEXT sets the system message (/system alone
    removes it; each says so on stderr), /help prints the commands on stderr, Ctrl-C stops a
    reply (not the program), /exit or Ctrl-D ends. A message that does not fit the context
    (or that the template refuses), or a line starting with "/" that is no command (a typo:
    /rest, /sytem TEXT; /reset with text), gets one line on stderr and the conversation goes
    on; a line starting with a space goes to the model as it is.
    With standard input not a terminal it reads one message per line and prints each reply on
    its own line(s), so it can be scripted; there such a message ends the program (exit 2).

    Args:
        source: the model (`ModelSource`: --run, --hf or --gguf; --device, --no-verify).
        chat_template: a Jinja chat template file (default: the model's own).
        system: the system message to start with.
        max_new_tokens: the most tokens of a reply.
        temperature: 0 is greedy.
        top_k: sample among the K likeliest tokens.
        top_p: sample among the likeliest tokens whose probabilities sum to P.
        seed: the same seed gives the same conversation (reply i uses seed + i).
        decoding: how the model decodes (`Decoding`: --dtype, --quantize, --compile).

    Returns:
        0, the exit status.

    Raises:
        UserError / MissingFileError: as `decoderlm sample`; a model without a chat template
            (and no --chat-template); a template that fails on the conversation.
    """
    params = from_flags(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
    )
    model, tokenizer = load_for_decoding(source, decoding)
    template = chat_template_of(tokenizer, chat_template)
    if template is None:
        raise UserError(
            "this model has no chat template; give one with --chat-template FILE (a Jinja "
            "template), or use decoderlm sample"
        )
    context = model.config.max_positions or model.config.block_size
    conversation = Conversation(template, context, max_new_tokens, system)
    interactive, prefixes = sys.stdin.isatty(), PrefixCache(1)
    if interactive:
        print(HELP)
    for n, message in enumerate(_messages(interactive)):
        try:
            if _command(message, conversation):
                continue
            ids = conversation.prompt(message)
        except UserError as e:  # at a terminal: say so and read the next message
            if not interactive:
                raise
            print(f"decoderlm: error: {e}", file=sys.stderr)
            continue
        turn_params = params if seed is None else replace(params, seed=seed + n)
        reply = _reply(model, tokenizer, ids, turn_params, template.end_ids, prefixes)
        conversation.turns.append({"role": "assistant", "content": reply})
    return 0


def _messages(interactive: bool):
    """The user's messages: prompted lines on a terminal (until /exit or Ctrl-D), else the
    non-empty lines of standard input."""
    if not interactive:
        for line in sys.stdin:
            if line.strip() == "/exit":
                return
            if line.strip():
                yield line.rstrip("\n")
        return
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt
            print()
            continue
        if line.strip() == "/exit":
            return
        if line.strip():
            yield line


def _command(message: str, conversation: Conversation) -> bool:
    """Carry out a command, a line starting with "/": /reset, /system [TEXT] (no TEXT: no
    system message), each confirmed in one line on stderr, or /help (the commands, on
    stderr); whether `message` was one (False: a message for the model).

    Raises:
        UserError: a line starting with "/" that is no command (a typo such as /rest or
            /sytem TEXT), or /reset, /help or /exit with text; it is not sent to the model.
    """
    if not message.startswith("/"):
        return False
    word, *text = message.split(maxsplit=1)
    if word == "/system":
        conversation.system = text[0].strip() if text else None
        conversation.turns.clear()
        said = "system message set" if conversation.system else "no system message"
        print(f"decoderlm: {said}; the conversation starts again", file=sys.stderr)
        return True
    if word not in ("/reset", "/help", "/exit"):  # /exit alone ends before (`_messages`)
        raise UserError(
            f"unknown command {word}; the commands are {COMMANDS} (to send a line starting "
            'with "/" to the model, start it with a space)'
        )
    if text:
        raise UserError(f"{word} takes no text; the commands are {COMMANDS}")
    if word == "/reset":
        conversation.turns.clear()
        print("decoderlm: the conversation starts again", file=sys.stderr)
    else:
        print(HELP, file=sys.stderr)
    return True


def _reply(model, tokenizer, ids, params, end_ids, prefixes) -> str:
    """Stream a reply to stdout and return its text (what was written when Ctrl-C stops it)."""
    text = ""
    try:
        for delta, *_ in stream_text(model, tokenizer, ids, params, end_ids, prefixes):
            text += delta
            sys.stdout.write(delta)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write(" [interrupted]")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return text
