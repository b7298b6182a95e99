"""Conversations to fine-tune on (`decoderlm train --init-from MODEL --data chats.jsonl`): read
from JSONL, rendered with the model's chat template, trained on the assistant's replies only.

Each non-empty line of the file is one JSON object in one of these shapes:

    {"messages": [{"role": "system" | "developer" | "user" | "assistant",
                   "content": "text" or [{"type": "text", "text": "..."}, ...]}, ...]}
                        OpenAI's fine-tuning format; at least one assistant message
    {"instruction": "...", "input": "..." (optional), "output": "..."}
                        Alpaca: one user message (the instruction, then a blank line and the
                        input when there is one) and the output as the reply
    {"prompt": "...", "completion": "..."}
                        one user message and the completion as the reply
    {"conversations": [{"from": "system" | "human" | "gpt", "value": "..."}, ...]}
                        ShareGPT: human is the user, gpt the assistant

A conversation's tokens are the template's rendering of all its messages (`ChatTemplate`,
without the generation prompt). Reply i (the i-th assistant message) is the tokens between the
rendering of the messages before it with the generation prompt and the rendering of the
messages up to it; the loss covers those tokens up to and including the template's end-of-turn
token (so the model learns to stop; what the template writes after it, such as ChatML's
newline, is not trained). Every rendering of a prefix must be a prefix of the whole
conversation's tokens: a template that is not prefix-preserving (one that rewrites earlier
turns, or whose tokens merge across a turn's boundary) is refused, naming the line, since the
replies' tokens cannot then be found. TRL's assistant-only loss and its prefix check do the
same; litgpt's prompt masking is the single-turn case.

`Conversations` holds the encoded conversations one after the other; a training or evaluation
window is one conversation from its first token (causal attention: what follows it in the
window is never seen by its tokens, and is not trained), so windows are drawn per conversation
rather than per token (see `decoderlm.data.corpus.window_count` and `windows`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..tokenizers.chat_template import ChatTemplate, ChatTemplateError

__all__ = ["Conversations", "encode_conversation", "is_conversation_file", "read_conversations"]

ROLES = ("system", "developer", "user", "assistant")
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant"}
_SHAPES = (
    'a line is {"messages": [...]}, {"instruction", "input", "output"}, {"prompt", '
    '"completion"} or {"conversations": [{"from", "value"}, ...]}'
)


def is_conversation_file(path: str | Path | None) -> bool:
    """Whether `path` is a conversations file: an existing file named *.jsonl."""
    return path is not None and Path(path).suffix == ".jsonl" and Path(path).is_file()


def _text(content, where: str) -> str:
    """A message's content as one string (a list of text parts joined with no separator)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise UserError(f"{where}: content must be a string or a list of {{'type': 'text', 'text'}}")


def _messages(record, where: str) -> list[dict]:
    """The {"role", "content": str} messages of one line's object (see the module docstring)."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: not a JSON object; {_SHAPES}")
    if "messages" in record:
        raw = record["messages"]
        if not isinstance(raw, list) or not raw:
            raise UserError(f"{where}: messages must be a non-empty list")
        messages = []
        for j, m in enumerate(raw):
            at = f"{where}, message {j + 1}"
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise UserError(f"{at}: role must be one of {', '.join(ROLES)}")
            messages.append({"role": m["role"], "content": _text(m.get("content"), at)})
    elif "conversations" in record and isinstance(record["conversations"], list):
        messages = []
        for j, m in enumerate(record["conversations"]):
            at = f"{where}, turn {j + 1}"
            if not isinstance(m, dict) or m.get("from") not in _SHAREGPT_ROLES:
                raise UserError(f"{at}: from must be one of {', '.join(_SHAREGPT_ROLES)}")
            messages.append(
                {"role": _SHAREGPT_ROLES[m["from"]], "content": _text(m.get("value"), at)}
            )
    elif "instruction" in record and "output" in record:
        prompt = _text(record["instruction"], f"{where}, instruction")
        extra = _text(record.get("input") or "", f"{where}, input")
        prompt = f"{prompt}\n\n{extra}" if extra else prompt
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": _text(record["output"], f"{where}, output")},
        ]
    elif "prompt" in record and "completion" in record:
        messages = [
            {"role": "user", "content": _text(record["prompt"], f"{where}, prompt")},
            {"role": "assistant", "content": _text(record["completion"], f"{where}, completion")},
        ]
    else:
        raise UserError(f"{where}: {_SHAPES}")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no assistant message, so nothing to train on")
    return messages


def read_conversations(path: str | Path) -> list[tuple[int, list[dict]]]:
    """The conversations of a JSONL file: (line number, [{"role", "content": str}, ...]) for
    every non-empty line, in order (shapes: the module docstring).

    Raises:
        UserError: the file is not UTF-8, a line is not JSON or not one of the shapes (the
            message names the line number), or the file holds no conversation.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    conversations = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not JSON ({e.msg}, column {e.colno})") from None
        conversations.append((number, _messages(record, where)))
    if not conversations:
        raise UserError(f"{path} holds no conversation; {_SHAPES}")
    return conversations


def encode_conversation(
    template: ChatTemplate, messages: list[dict], where: str = "the conversation"
) -> tuple[list[int], list[bool]]:
    """The token ids of a conversation and which of them the loss covers.

    Returns:
        (ids, trained): ids [T] of the template's rendering of every message (no generation
        prompt); trained [T] True for the assistant replies' tokens, each through its
        end-of-turn token (`ChatTemplate.end_ids`), False elsewhere.

    Raises:
        UserError: the template fails on the messages, or a prefix's rendering is not a
            prefix of the whole conversation's ids (`where` names the line).
    """
    try:
        ids = template.encode(messages, add_generation_prompt=False)
        trained = [False] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = template.encode(messages[:i], add_generation_prompt=True) if i else []
            end = template.encode(messages[: i + 1], add_generation_prompt=False)
            for prefix in (start, end):
                if ids[: len(prefix)] != prefix:
                    raise UserError(
                        f"{where}: the chat template's rendering of the messages before "
                        f"message {i + 1} is not a prefix of the whole conversation's tokens, "
                        f"so its reply's tokens cannot be found; fine-tuning on conversations "
                        f"needs a template that renders earlier turns unchanged"
                    )
            reply = ids[len(start) : len(end)]
            stop = next((k for k, t in enumerate(reply) if t in template.end_ids), len(reply) - 1)
            trained[len(start) : len(start) + stop + 1] = [True] * (stop + 1)
    except ChatTemplateError as e:
        raise UserError(f"{where}: {e}") from None
    return ids, trained


@dataclass(frozen=True)
class Conversations:
    """Encoded conversations, one after the other.

    Attributes:
        ids: [N + pad] int64 token ids of every conversation in order, then `longest + 1`
            padding ids (0) so that a window of any conversation lies inside.
        targets: [N + pad] int64: ids[i] where token i is trained (a reply's token), else -1
            (the model's ignore_index); window y of a conversation is targets shifted by one.
        starts, ends: [C] int64 offsets of each conversation's first token and one past its
            last.
        lines: [C] the line of the file each conversation came from (for messages).
    """

    ids: np.ndarray
    targets: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    lines: np.ndarray

    @classmethod
    def encode(cls, conversations: list[tuple[int, list[dict]]], template, path) -> Conversations:
        """Encode `read_conversations`' output with `template` (`encode_conversation`)."""
        ids, targets, starts, ends = [], [], [], []
        for number, messages in conversations:
            conv, trained = encode_conversation(template, messages, f"{path} line {number}")
            starts.append(len(ids))
            ids += conv
            targets += [t if keep else -1 for t, keep in zip(conv, trained, strict=True)]
            ends.append(len(ids))
        lines = [number for number, _ in conversations]
        return cls._padded(
            *(np.asarray(a, dtype=np.int64) for a in (ids, targets, starts, ends, lines))
        )

    @classmethod
    def _padded(cls, ids, targets, starts, ends, lines) -> Conversations:
        """Conversations of unpadded [N] ids and targets, with the padding of `ids` added."""
        pad = int((ends - starts).max()) + 1 if len(starts) else 0
        ids = np.concatenate([ids, np.zeros(pad, dtype=np.int64)])
        targets = np.concatenate([targets, np.full(pad, -1, dtype=np.int64)])
        return cls(ids, targets, starts, ends, lines)

    def __len__(self) -> int:
        """N: the conversations' tokens (padding left out)."""
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def count(self) -> int:
        """C: how many conversations."""
        return len(self.starts)

    @property
    def lengths(self) -> np.ndarray:
        """[C] the tokens of each conversation."""
        return self.ends - self.starts

    @property
    def longest(self) -> int:
        """The most tokens of one conversation."""
        return int(self.lengths.max()) if self.count else 0

    @property
    def trained_tokens(self) -> int:
        """How many tokens the loss covers."""
        return int((self.targets >= 0).sum())

    def tokens(self) -> np.ndarray:
        """[N] the conversations' ids one after the other (padding left out)."""
        return self.ids[: len(self)]

    def subset(self, index: slice) -> Conversations:
        """The conversations `index` selects (a slice of 0..C-1), with their own padding."""
        starts, ends = self.starts[index], self.ends[index]
        lo, hi = (int(starts[0]), int(ends[-1])) if len(starts) else (0, 0)
        ids, targets = self.ids[lo:hi], self.targets[lo:hi]
        return self._padded(ids, targets, starts - lo, ends - lo, self.lines[index])

    def split(self, val_fraction: float) -> tuple[Conversations, Conversations]:
        """(train, validation): the first 1 - val_fraction of the conversations and the rest,
        at least one conversation in validation when val_fraction > 0 and there are two."""
        n_val = round(val_fraction * self.count)
        if val_fraction > 0 and self.count > 1:
            n_val = min(max(n_val, 1), self.count - 1)
        cut = self.count - n_val
        return self.subset(slice(0, cut)), self.subset(slice(cut, self.count))

    def window_length(self, block_size: int) -> int:
        """W: the windows' length, the longest conversation's tokens up to block_size."""
        return min(block_size, self.longest)

    def windows(self, index: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) [len(index), W] int64 of conversations `index` (W = `window_length`): x the
        conversation's first W ids, y[b, t] the target of x[b, t] (the next token where it is
        a reply's token of the same conversation, else -1)."""
        W = self.window_length(block_size)
        starts, ends = self.starts[index.numpy()], self.ends[index.numpy()]
        offsets = starts[:, None] + np.arange(W + 1)
        x = torch.from_numpy(self.ids[offsets[:, :-1]])
        y = self.targets[offsets[:, 1:]].copy()
        y[offsets[:, 1:] >= ends[:, None]] = -1
        return x.contiguous(), torch.from_numpy(y)

    def check_fits(self, name: str, block_size: int) -> None:
        """Raise UserError when the split has no conversation, or a conversation has no
        trained token in its first block_size + 1 tokens (its window would train nothing),
        naming the line."""
        if not self.count:
            raise UserError(
                f"the {name} split has no conversation; give at least two conversations (the "
                f"last --val-fraction of them, one at least, is the validation split)"
            )
        trained = self.targets >= 0
        for s, e, line in zip(self.starts, self.ends, self.lines, strict=True):
            if not trained[s + 1 : min(e, s + block_size + 1)].any():
                raise UserError(
                    f"line {line}: no reply token lies within the first {block_size} tokens "
                    f"(block_size) of its {e - s} tokens; shorten the conversation"
                )
