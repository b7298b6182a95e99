"""The evaluation loss, and scoring a trained run on a whole split or a text (`decoderlm eval`).

`evaluate` is the mean next-token cross-entropy over every non-overlapping block_size window
of the ids (windows start at 0, T, 2T, ...; deterministic, no dropout), so the tokens scored
are the n_windows * T targets 1 .. n_windows * T; the few tokens after the last full window
are not scored, and `evaluate_source`'s report (`evaluate_run`'s for a run directory) says how
many were. Training logs the same loss on the validation split. `print_report` is the
`decoderlm eval` command.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch

from .arguments import Fields, NotEmptyStr, PositiveInt, Quantize
from .data.conversations import is_conversation_file
from .data.corpus import (
    check_split,
    is_token_dir,
    load_corpus,
    load_token_dir,
    scored_windows,
    windows,
)
from .data.prepare import encode_source, source_files
from .errors import UserError
from .files import json_text, read_json
from .generation.loading import load_for_decoding
from .model.model import DecoderLM, eval_mode
from .model.weights import CONFIG_NAME
from .options import DecodeDtypeName, ModelSource, Precision
from .tokenizers import CharTokenizer, Tokenizer

__all__ = [
    "LN2",
    "evaluate",
    "token_logprobs",
    "score_window_starts",
    "evaluate_run",
    "evaluate_source",
    "format_report",
    "print_report",
]

LN2 = math.log(2.0)  # nats per bit: bits = nats / LN2


@torch.no_grad()
def evaluate(
    model: DecoderLM,
    data: torch.Tensor | np.ndarray,
    max_windows: int | None = None,
    batch_size: int = 32,
    autocast=contextlib.nullcontext,
) -> float:
    """Mean next-token loss (nats per token) over non-overlapping block_size windows of data.

    Deterministic: the windows start at 0, T, 2T, ... (all of them, or max_windows of them
    spread evenly over the split). The model runs in eval mode (no dropout) and its previous
    mode is restored afterwards. `Conversations` are scored one window per conversation, on
    their replies' tokens only (the mean over those tokens).

    Args:
        model: the DecoderLM.
        data: [N] int64 token ids (or a NumPy array / np.memmap), N > block_size; or
            `decoderlm.data.conversations.Conversations`.
        max_windows: evaluate at most this many windows (None: every window).
        batch_size: windows per forward pass.
        autocast: a context-manager factory, e.g. bfloat16 autocast.

    Raises:
        UserError: data is too short for one window.
    """
    T = model.config.block_size
    check_split("evaluation", data, T)
    starts = scored_windows(data, T)
    n_windows = len(starts)
    if max_windows is not None and n_windows > max_windows:
        starts = starts[torch.linspace(0, n_windows - 1, max_windows).long()]
    total, count = 0.0, 0
    with eval_mode(model):
        device = model.device
        for chunk in starts.split(batch_size):
            x, y = windows(data, chunk, T)
            with autocast():
                _, loss = model(x.to(device), y.to(device))
            scored = int((y != -1).sum())  # every target, but a conversation's replies' only
            total += float(loss) * scored
            count += scored
    return total / count


def score_window_starts(n: int, T: int) -> list[int]:
    """The windows that score every one of n ids (n >= 2) with a context of at most T: the
    non-overlapping windows of `evaluate` (inputs ids[s : s + T], s = 0, T, 2T, ...), and when
    ids remain after the last full one, a last window ending at the last id, ids[n - T - 1 :],
    whose outputs count only for the ids not scored yet (they see up to T earlier ids).
    A window starting at s predicts ids s + 1 .. s + T."""
    if n - 1 <= T:
        return [0]
    full = (n - 1) // T
    starts = [k * T for k in range(full)]
    return starts + [n - 1 - T] if full * T < n - 1 else starts


@torch.no_grad()
def token_logprobs(
    model: DecoderLM, ids: list[int], top_k: int = 0, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probability (nats) of every id given the ids before it, as `evaluate` scores them.

    The log-softmax of the raw logits (no temperature, top-k or top-p), over the first
    `vocab_size` logits (default: all of them; less when a tokenizer has fewer ids).
    Windows: `score_window_starts` with T = block_size, so a sequence longer than the context
    is scored in non-overlapping windows of T and the first ids of each window see only
    the window's earlier ids.

    Args:
        model: the DecoderLM (run in eval mode; its mode is restored).
        ids: n >= 1 token ids.
        top_k: also return the top_k most likely ids at every position.

    Returns:
        (logprobs [n - 1] float32, of ids[1:]; top_values [n - 1, top_k] float32 and top_ids
        [n - 1, top_k] int64, the top_k log-probabilities at each of those positions, largest
        first).
    """
    T, n = model.config.block_size, len(ids)
    V = vocab_size or model.config.vocab_size
    data = torch.tensor(ids, dtype=torch.long)
    logprobs = torch.empty(max(n - 1, 0))
    top_values = torch.empty(max(n - 1, 0), top_k)
    top_ids = torch.empty(max(n - 1, 0), top_k, dtype=torch.long)
    with eval_mode(model):
        done = 0  # ids[1 : done + 1] are scored
        for s in score_window_starts(n, T) if n > 1 else []:
            width = min(T, n - 1 - s)
            x, y = windows(data, torch.tensor([s]), width)
            lp = model(x.to(model.device))[0][0, :, :V].float().log_softmax(-1).cpu()
            keep = slice(done - s, width)  # outputs of the ids not scored yet
            logprobs[done : s + width] = lp[keep].gather(1, y[0, keep, None])[:, 0]
            if top_k:
                top = lp[keep].topk(top_k, dim=-1)
                top_values[done : s + width], top_ids[done : s + width] = top
            done = s + width
    return logprobs, top_values, top_ids


def _encode_text_files(tokenizer: Tokenizer, data: Path) -> tuple[np.ndarray, int]:
    """All ids of the text file(s) at `data`, unknown characters mapped to the unk id."""
    parts, n_unknown = [], 0
    for path in source_files([data]):
        try:
            ids, n = encode_source(tokenizer, path, unknown="unk")
        except ValueError as e:  # named once: the message may hold the path already
            raise UserError(str(e) if str(path) in str(e) else f"{path}: {e}") from None
        parts.append(ids)
        n_unknown += n
    return np.concatenate(parts), n_unknown


def _ids_of_data_spec(run: Path, tokenizer: Tokenizer, split: str) -> tuple[np.ndarray, int, str]:
    config = read_json(run / CONFIG_NAME)
    spec = config.get("data_spec") if isinstance(config, dict) else None
    if not isinstance(spec, dict):  # a user-facing file problem: ValueError, as elsewhere
        raise UserError(
            f"{run / CONFIG_NAME} does not record the run's data (no 'data_spec', written by "
            f"runs of this version on); pass --data PATH to evaluate on a text file or a "
            f"prepared token directory"
        )
    if spec.get("token_dir"):
        return _ids_of_token_dir(Path(spec["token_dir"]), tokenizer, split)
    if is_conversation_file(spec.get("path")):
        raise UserError(
            f"{run} trained on the conversations of {spec['path']}, which `decoderlm eval` "
            f"does not score (the loss on the held-out replies is each record's val_loss in "
            f"the training run's metrics.jsonl); pass --data PATH to evaluate on a text file"
        )
    _, train_ids, val_ids, source, _ = load_corpus(spec, tokenizer)
    ids = val_ids if split == "val" else train_ids
    unk = getattr(tokenizer, "unk_id", None)  # a fine-tuning run maps unknown characters
    n_unknown = int((ids == unk).sum()) if spec.get("unknown") == "unk" and unk is not None else 0
    return ids, n_unknown, source


def _ids_of_token_dir(path: Path, tokenizer: Tokenizer, split: str) -> tuple[np.ndarray, int, str]:
    tokens = load_token_dir(path)
    if tokens.tokenizer.to_dict() != tokenizer.to_dict():
        raise UserError(
            f"{path} was prepared with another tokenizer ({tokens.tokenizer!r}) "
            f"than the run's ({tokenizer!r}); its ids mean other tokens. Pass the "
            f"text file to encode it with the run's tokenizer"
        )
    return tokens.split(split), int(tokens.meta.get("unknown_characters", 0)), str(path)


def evaluate_run(
    run: str | Path,
    data: str | Path | None = None,
    split: str | None = None,
    device: str = "cpu",
    batch_size: int = 32,
    verify: bool = True,
    dtype: DecodeDtypeName | None = None,
    quantize: Quantize | None = None,
) -> dict:
    """Loss of the model in run directory `run` on a whole split or text: `evaluate_source`
    of ModelSource(run, device, no_verify=not verify) at Precision(dtype, quantize).

    Args:
        run: a run directory (model.safetensors, config.json, its tokenizer files), or a
            LoRA run's adapter directory (loaded over its base model).
        data, split, batch_size: as `evaluate_source`.
        device: where the model runs.
        verify: check the weights against the digests config.json records (see
            `decoderlm.model.weights.verify_file`).
        dtype, quantize: score the model as decoding runs it at that precision (see
            `generation.precision.prepare_for_decoding`; default float32 weights).

    Returns:
        The dict of `evaluate_source`.

    Raises:
        UserError / MissingFileError: as `evaluate_source`.
    """
    source = ModelSource(run=str(run), device=device, no_verify=not verify)
    return evaluate_source(source, data, split, batch_size, Precision(dtype, quantize))


def evaluate_source(
    source: ModelSource,
    data: str | Path | None = None,
    split: str | None = None,
    batch_size: int = 32,
    precision: Precision | None = None,
    block_size: int | None = None,
) -> dict:
    """Loss of the model of `source` (a run directory, a Hugging Face directory or a GGUF
    file) on a whole split or text.

    Args:
        source: the model (an adapter directory is loaded over its base model).
        data: None (a run's own data, from config.json's "data_spec"; a Hugging Face
            directory or GGUF file records none); a prepared token directory (its `split`,
            default "val"; it must use the model's tokenizer); or a text file / directory of
            text files (all of it), encoded with the model's tokenizer, with characters
            outside a char vocabulary mapped to its unknown token and counted.
        split: "val" (default) or "train"; not for a text file.
        batch_size: windows per forward pass.
        precision: score the model as decoding runs it at that precision (see
            `generation.precision.prepare_for_decoding`; default float32 weights).
        block_size: score in windows of this many tokens (the model's context cropped to it,
            `DecoderLM.crop_block_size`); None: the model's block_size.

    Returns:
        A dict: run (the run directory, Hugging Face directory or GGUF file scored), data
        (where the ids came from), split, tokenizer (kind), nats_per_token, bits_per_token,
        bits_per_char (char tokenizer) or bits_per_byte (byte tokenizer; GPT-2 BPE: nats per
        token x tokens_scored / bytes_scored / ln 2, with bytes_scored the UTF-8 bytes of the
        scored tokens), perplexity
        (exp(nats_per_token)), tokens (in the split or text), tokens_scored, windows,
        block_size, unknown_characters, unk_token (char tokenizer); for any other tokenizer
        also bytes_scored (the UTF-8 bytes of the scored tokens, decoded) and bits_per_byte
        (nats_per_token * tokens_scored / (ln 2 * bytes_scored), lm-evaluation-harness's
        bits_per_byte), which compares models with different tokenizers.

    Raises:
        UserError / MissingFileError: missing or damaged files; a run without data_spec, or
            a Hugging Face directory or GGUF file, and no `data`; a text with unknown
            characters and a char vocabulary without an unknown token; ids shorter than
            block_size + 1; a block_size above the model's; as
            `generation.loading.load_for_decoding`.
    """
    if split not in (None, "val", "train"):
        raise UserError(f"unknown split {split!r}; use 'val' or 'train'")
    if data is None and source.run is None and source.path is not None:
        flag = "--hf" if source.hf else "--gguf"
        raise UserError(
            f"{flag} {source.path} records no data to score; give --data PATH (a text file "
            f"or a prepared token directory)"
        )
    model, tokenizer = load_for_decoding(source, precision)  # an adapter run: over its base
    if block_size is not None:
        model.crop_block_size(block_size)
    if data is None:
        split = split or "val"
        ids, n_unknown, where = _ids_of_data_spec(Path(source.run), tokenizer, split)
    elif is_token_dir(data):
        split = split or "val"
        ids, n_unknown, where = _ids_of_token_dir(Path(data), tokenizer, split)
    elif split is not None:
        raise UserError(
            f"--split chooses a split of the run's data or of a prepared token "
            f"directory; {data} is text, which is scored whole"
        )
    else:
        (ids, n_unknown), where = _encode_text_files(tokenizer, Path(data)), str(data)
    T = model.config.block_size
    nats = evaluate(model, ids, None, batch_size)  # checks len(ids) > block_size
    n_windows = (len(ids) - 1) // T
    report = {
        "run": str(source.path),
        "data": where,
        "split": split,
        "tokenizer": tokenizer.kind,
        "nats_per_token": nats,
        "bits_per_token": nats / LN2,
        "perplexity": math.exp(nats),
        "tokens": len(ids),
        "tokens_scored": n_windows * T,
        "windows": n_windows,
        "block_size": T,
        "unknown_characters": n_unknown,
    }
    if tokenizer.kind in ("char", "byte"):
        report[f"bits_per_{tokenizer.kind}"] = nats / LN2
    elif tokenizer.kind == "gpt2":  # byte-level BPE: the scored tokens' bytes, exactly
        scored = [int(i) for i in ids[1 : n_windows * T + 1]]
        report["bytes_scored"] = len(tokenizer.encoding.decode_bytes(scored))
        report["bits_per_byte"] = nats * n_windows * T / report["bytes_scored"] / LN2
    else:  # the UTF-8 bytes of the decoded scored tokens
        scored = [int(i) for i in ids[1 : 1 + n_windows * T]]
        report["bytes_scored"] = len(tokenizer.decode(scored).encode("utf-8"))
        report["bits_per_byte"] = nats * n_windows * T / (LN2 * report["bytes_scored"])
    if isinstance(tokenizer, CharTokenizer):
        report["unk_token"] = tokenizer.unk_token
    return report


def format_report(report: dict) -> str:
    """The report of `evaluate_run` as a few lines of text."""
    where = report["data"] + (f" [split: {report['split']}]" if report["split"] else "")
    unit = {"char": "bits/char", "byte": "bits/byte"}.get(report["tokenizer"], "bits/token")
    lines = [
        f"data: {where}",
        (
            f"scored {report['tokens_scored']:,} tokens of {report['tokens']:,} "
            f"({report['windows']:,} non-overlapping windows of block_size "
            f"{report['block_size']}; the first token and the "
            f"{report['tokens'] - 1 - report['tokens_scored']:,} after the last full window are "
            f"not predicted)"
        ),
        (
            f"loss {report['nats_per_token']:.4f} nats/token = {report['bits_per_token']:.4f} "
            f"{unit}, perplexity {report['perplexity']:.3f}"
            + (
                f"; {report['bits_per_byte']:.4f} bits/byte over {report['bytes_scored']:,} bytes"
                if "bytes_scored" in report
                else ""
            )
        ),
    ]
    if report["tokenizer"] == "char":
        unk = report.get("unk_token")
        mapped = f" (mapped to the unknown token {unk!r})" if unk is not None else ""
        lines.append(f"unknown characters: {report['unknown_characters']:,}{mapped}")
    return "\n".join(lines)


def print_report(
    source: Annotated[ModelSource, Fields(ModelSource)] = ModelSource(),
    data: NotEmptyStr | None = None,
    split: Literal["val", "train"] | None = None,
    json: bool = False,
    batch_size: PositiveInt = 32,
    precision: Annotated[Precision, Fields(Precision)] = Precision(),
    block_size: PositiveInt | None = None,
) -> int:
    """Loss, bits per character and perplexity of a run.

    Score a run on a whole split of its own data (--split), a prepared token directory or a
    text file (--data): mean next-token loss over non-overlapping block_size windows. A
    Hugging Face directory (--hf) or GGUF file (--gguf) is scored on --data.

    Args:
        source: the model (`ModelSource`: --run, --hf or --gguf; --device, --no-verify, --threads).
        data: a text file (scored whole, unknown characters mapped to the run's unknown token
            and counted; its <|endoftext|> strings are ordinary text) or a prepared token
            directory (default: the data the run was trained on).
        split: split of the run's data or of a token directory (default: val).
        json: print JSON instead of text.
        batch_size: windows per forward pass.
        precision: score the model as it decodes at that precision (`Precision`: --dtype,
            --quantize).
        block_size: windows of this many tokens, at most the model's context (default: the
            model's block_size; an open model's is thousands of tokens, so a short text needs
            a smaller one).

    Returns:
        0, the exit status.

    Raises:
        UserError / MissingFileError: as `evaluate_source`.
    """
    report = evaluate_source(source, data, split, batch_size, precision, block_size)
    print(json_text(report) if json else format_report(report))
    return 0
