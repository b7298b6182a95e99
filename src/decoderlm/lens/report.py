"""The lens report: one self-contained HTML file (`decoderlm inspect`, and report.html of a
training run) and the same data as JSON beside it.

`inspect` is the `decoderlm inspect` command: a model, a text, the report written.

`build_report` runs the analyses of `decoderlm.lens.lens` on one text and gathers their results as
JSON-ready data; `write_report` puts that data into the page template
(templates/report.html: hand-written JavaScript and SVG, no library, nothing fetched), so
the file shows everything with the network off. Attention probabilities, the largest part,
are stored as uint8 (round(255 p)) of the lower triangle only, base64-encoded.
"""

from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path
from typing import Annotated

import numpy as np
import torch

from ..arguments import Fields, NonNegativeInt, NotEmptyStr, PositiveInt
from ..errors import UserError, one_of
from ..files import atomic_write, read_text
from ..generation.loading import load_for_decoding
from ..model.model import DecoderLM
from ..options import ModelSource, Precision
from ..tokenizers import Tokenizer
from .lens import (
    attention_patterns,
    default_probe,
    embedding_map,
    head_scores,
    logit_lens,
    patch_heads,
    patch_resid_pre,
    surprisal,
    token_byte_counts,
)

__all__ = ["build_report", "inspect", "write_report", "quantize_attention", "unquantize_attention"]

_DATA_MARK = "/*REPORT_DATA*/null"


def _r(x, digits: int = 4):
    """A tensor or float as nested lists of floats rounded to `digits` (NaN -> None)."""
    values = torch.as_tensor(x).float().tolist()

    def rounded(v):
        if isinstance(v, list):
            return [rounded(u) for u in v]
        return None if v != v else round(v, digits)

    return rounded(values)


def quantize_attention(att: torch.Tensor) -> bytes:
    """Probabilities [n_layers, n_heads, T, T] -> bytes: for each layer, head and query row t
    (in that order), round(255 p) as uint8 of keys 0 .. t (T (T + 1) / 2 bytes a head)."""
    T = att.size(-1)
    rows, cols = torch.tril_indices(T, T)
    q = (att[..., rows, cols].float().clamp(0, 1) * 255).round().to(torch.uint8)
    return q.cpu().numpy().tobytes()


def _labels(tokenizer: Tokenizer, ids) -> list[str]:
    """Each token's text (bytes that are not whole UTF-8 characters shown as U+FFFD; an id the
    tokenizer lacks, e.g. a padded vocabulary's, as <id>)."""
    out = []
    for i in ids:
        try:
            out.append(tokenizer.decode([int(i)]))
        except ValueError:
            out.append(f"<{int(i)}>")
    return out


def _guesses(tokenizer, top_ids, top_probs) -> list:
    """[[label, probability], ...] per row of top_ids / top_probs [N, k]."""
    return [
        [[label, round(float(p), 4)] for label, p in zip(_labels(tokenizer, ids), ps, strict=True)]
        for ids, ps in zip(top_ids, top_probs, strict=True)
    ]


def _model_info(model: DecoderLM) -> dict:
    c = model.config
    return {
        "n_layers": c.n_layers,
        "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads,
        "d_model": c.d_model,
        "vocab_size": c.vocab_size,
        "block_size": c.block_size,
        "parameters": model.num_parameters(),
        "pos_encoding": c.pos_encoding,
        "norm_position": c.norm_position,
    }


def _patching(model, tokenizer, ids, corrupted) -> dict:
    """Patching of resid_pre and head outputs. Answer: the clean run's top next token;
    wrong: the corrupted run's top token (or the clean run's second when they agree)."""
    if len(corrupted) != len(ids):
        raise UserError(
            f"--corrupt must have as many tokens as the text ({len(corrupted)} vs {len(ids)}); "
            f"change a few characters or words without changing the length"
        )
    clean_t, corrupt_t = torch.tensor(ids), torch.tensor(corrupted)
    with torch.no_grad():
        clean_top = model(clean_t[None].to(model.device))[0][0, -1].topk(2).indices.tolist()
        corrupt_top = int(model(corrupt_t[None].to(model.device))[0][0, -1].argmax())
    answer = clean_top[0]
    wrong = corrupt_top if corrupt_top != answer else clean_top[1]
    return {
        "corrupted": _labels(tokenizer, corrupted),
        "answer": _labels(tokenizer, [answer])[0],
        "wrong": _labels(tokenizer, [wrong])[0],
        "resid_pre": _r(patch_resid_pre(model, clean_t, corrupt_t, answer, wrong), 3),
        "heads": _r(patch_heads(model, clean_t, corrupt_t, answer, wrong), 3),
    }


@torch.no_grad()
def build_report(
    model: DecoderLM,
    tokenizer: Tokenizer,
    ids: list[int],
    layers: list[int] | None = None,
    corrupted: list[int] | None = None,
    k: int = 5,
    title: str = "",
) -> dict:
    """The data of a report on one text, JSON-ready.

    Args:
        model: the DecoderLM (put in eval mode).
        tokenizer: its tokenizer (labels, UTF-8 bytes per token).
        ids: the text's token ids, 2 <= len <= the model's max_positions.
        layers: the layers whose attention maps are stored (default: all).
        corrupted: token ids of a corrupted text of the same length: adds activation
            patching (see `decoderlm.lens.lens.patch_resid_pre`).
        k: top guesses per position.
        title: a line shown at the top.

    Returns:
        dict with model, tokens, surprisal, attention (uint8 lower triangle, base64),
        scores (on the text and on a repeated random probe), lens, embedding, patching.

    Raises:
        UserError: too few or too many tokens, a layer out of range, or a corrupted text of
            another length.
    """
    model.eval()
    c = model.config
    if not 2 <= len(ids) <= c.max_positions:
        raise UserError(f"the text must be 2 to {c.max_positions} tokens, got {len(ids)}")
    layers = list(range(c.n_layers)) if layers is None else sorted(set(layers))
    if any(not 0 <= layer < c.n_layers for layer in layers):
        raise UserError(f"--layers must be in 0..{c.n_layers - 1}, got {layers}")
    idx = torch.tensor(ids)
    s = surprisal(model, idx, k, token_byte_counts(tokenizer, ids))
    lens = logit_lens(model, idx, k)
    att = attention_patterns(model, idx[None])[layers, 0]  # [len(layers), n_heads, T, T]
    vocab = min(c.vocab_size, tokenizer.vocab_size)  # ids a padded vocabulary never trains
    probe = default_probe(vocab, c.block_size)
    emb = embedding_map(model, min(vocab, 512))
    return {
        "title": title,
        "model": _model_info(model),
        "tokens": _labels(tokenizer, ids),
        "surprisal": {
            "bits": _r(s["bits"], 3),
            "rank": s["rank"].tolist(),
            "top": _guesses(tokenizer, s["top_ids"], s["top_probs"]),
            "bits_per_token": round(float(s["bits_per_token"]), 4),
            "bits_per_byte": round(float(s["bits_per_byte"]), 4),
        },
        "attention": {
            "layers": layers,
            "n_heads": c.n_heads,
            "T": len(ids),
            "encoding": "uint8 round(255 p), lower triangle row by row, per layer then head",
            "data": base64.b64encode(quantize_attention(att)).decode("ascii"),
        },
        "scores": {
            "text": {name: _r(v, 3) for name, v in head_scores(model, idx[None]).items()},
            "probe": {name: _r(v, 3) for name, v in head_scores(model, probe).items()},
            "probe_shape": list(probe.shape),
        },
        "lens": {
            "top": [_labels(tokenizer, row[:, 0]) for row in lens["top_ids"]],
            "top_prob": _r(lens["top_probs"][..., 0], 3),
            "next_prob": _r(lens["next_prob"], 3),
        },
        "embedding": {
            "tokens": _r(emb["tokens"], 3),
            "labels": _labels(tokenizer, range(emb["tokens"].size(0))),
            "positions": None if emb["positions"] is None else _r(emb["positions"], 3),
        },
        "patching": None if corrupted is None else _patching(model, tokenizer, ids, corrupted),
    }


def write_report(report: dict, path: str | Path) -> tuple[Path, Path]:
    """Write the report as one self-contained HTML file at `path` and its data as JSON
    beside it (same name, .json), each atomically; missing directories are created.

    Returns:
        (html path, json path).
    """
    path = Path(path)
    data = json.dumps(report, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    template = (
        resources.files("decoderlm.lens").joinpath("templates/report.html").read_text("utf-8")
    )
    safe = data.replace("</", "<\\/").replace("<!--", "<\\!--")  # cannot end the <script>
    html = template.replace(_DATA_MARK, safe)
    json_path = path.with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Path(tmp).write_text(html, encoding="utf-8"))
    atomic_write(json_path, lambda tmp: Path(tmp).write_text(data, encoding="utf-8"))
    return path, json_path


def unquantize_attention(data: str, n_layers: int, n_heads: int, T: int) -> np.ndarray:
    """The inverse of `quantize_attention` (after base64): [n_layers, n_heads, T, T] float32
    probabilities, to 1/255."""
    flat = np.frombuffer(base64.b64decode(data), dtype=np.uint8).reshape(n_layers, n_heads, -1)
    out = np.zeros((n_layers, n_heads, T, T), dtype=np.float32)
    rows, cols = np.tril_indices(T)
    out[..., rows, cols] = flat / 255.0
    return out


def _report_path(out: str | None) -> str:
    """The HTML file `inspect` writes: `out`, or report.html in the current directory when
    none is there yet; UserError (one line) for a name that is not a writable HTML file."""
    if out is None:
        if Path("report.html").exists():
            raise UserError(
                "report.html is already in the current directory; give --out FILE to write "
                "another file, or --out report.html to replace it"
            )
        return "report.html"
    if Path(out).is_dir() or out.endswith("/") or Path(out).suffix == ".json":
        raise UserError(
            f"--out {out} must name the HTML file (its data go beside it as .json), "
            f"e.g. --out {Path(out).with_suffix('') / 'report.html'}"
        )
    return out


def inspect(
    source: Annotated[ModelSource, Fields(ModelSource)] = ModelSource(),
    text: str | None = None,
    text_file: str | None = None,
    out: NotEmptyStr | None = None,
    layers: list[NonNegativeInt] | None = None,
    max_tokens: PositiveInt = 128,
    corrupt: str | None = None,
    precision: Annotated[Precision, Fields(Precision)] = Precision(),
) -> int:
    """Write an HTML report of what a model does on a text.

    One self-contained HTML file (nothing fetched; opens offline) with views linked by
    hovering a token: the text coloured by surprisal (bits) with the top guesses, the
    attention of every layer and head, previous-token / duplicate-token / induction head
    scores, the logit lens, the embedding map, and activation patching with --corrupt; the
    same data as JSON beside it (same name, .json). See decoderlm.lens.report.

    Args:
        source: the model (`ModelSource`: --run, --hf or --gguf; --device, --no-verify, --threads).
        text: the text to look at (give --text or --text-file); its <|endoftext|> is the
            end-of-text token where the vocabulary has one, as in a prompt.
        text_file: a UTF-8 file holding the text.
        out: the HTML file to write, replaced if it exists; a missing folder is made and
            named (default: report.html in the current directory, never replaced: name it
            with --out to replace it).
        layers: layers whose attention maps are stored (default: all); repeat for several.
        max_tokens: use the first N tokens of the text (at most the model's context).
        corrupt: a corrupted text with as many tokens as the text (after --max-tokens): adds
            the patching view (metric: the clean run's top next token against the corrupted
            run's).
        precision: look at the model as it decodes at that precision (`Precision`:
            --dtype, --quantize).

    Returns:
        0, the exit status.

    Raises:
        UserError / MissingFileError: not one of run, hf and gguf, or of text and text_file; `out`
            a directory or a .json name; no --out and a report.html already in the current
            directory; missing or damaged files; a text the vocabulary cannot encode, or too
            short.
    """
    one_of(text=text, text_file=text_file)
    out = _report_path(out)
    if text_file is not None:
        text = read_text(text_file, "--text-file")
    model, tokenizer = load_for_decoding(source, precision)
    n = min(max_tokens, model.config.max_positions)
    ids = tokenizer.encode(text, allowed_special="all")[:n]  # as a prompt
    corrupted = None if corrupt is None else tokenizer.encode(corrupt, allowed_special="all")[:n]
    title = f"{source.path}: {tokenizer.decode(ids)[:80]!r}"
    report = build_report(model, tokenizer, ids, layers, corrupted, title=title)
    folder = Path(out).parent
    made = "" if folder.is_dir() else f" (made the folder {folder})"
    html, data = write_report(report, out)
    print(f"wrote {html} ({html.stat().st_size:,} bytes) and {data} ({len(ids)} tokens){made}")
    return 0
