"""`decoderlm export`: a trained model as a Hugging Face directory or a GGUF file.

`export(run, format, out, outtype, overwrite)` reads a run directory (or any model directory
`decoderlm.model.weights.save_model` wrote, with its tokenizer) and writes it in `format`:

    hf      a directory transformers' AutoModelForCausalLM and AutoTokenizer load with no extra
            arguments (`decoderlm.io.hf`)
    gguf    one GGUF file llama.cpp loads (`decoderlm.io.gguf`)

Which models export as which architecture: `decoderlm.io.targets`. The output appears whole
or not at all (written under a temporary name, then renamed into place).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from ..arguments import NotEmptyPath
from ..errors import UserError
from ..files import make_temp_dir
from .gguf import check_gguf_dtype, save_gguf
from .hf import save_hf
from .load import load_run, load_tokenizer
from .targets import DTYPES, FORMATS, export_target

__all__ = ["export"]


def _check_out(out: Path, run: Path, format: str, overwrite: bool) -> None:
    """UserError when `out` exists and may not (or cannot) be replaced: without `overwrite`,
    or when it is the run directory `run`, a file or folder in it, or a folder above it
    (replacing it would destroy the model exported). A new path inside `run` is allowed."""
    if not out.exists():
        if not out.parent.is_dir():
            raise UserError(f"--out {out}: its directory {out.parent} does not exist")
        return
    if not overwrite:
        raise UserError(f"--out {out} already exists; pass --overwrite to replace it")
    here, source = out.resolve(), run.resolve()
    if here == source or source in here.parents or here in source.parents:
        raise UserError(
            f"--out {out} is the run directory {run}, in it or above it, and replacing it "
            "would delete the model; export to a new path"
        )
    if format == "gguf" and out.is_dir():
        raise UserError(f"--out {out} is a directory; a GGUF export is one file")
    if format == "hf" and not out.is_dir():
        raise UserError(f"--out {out} is a file; a Hugging Face export is a directory")


def _replace_dir(stage: Path, out: Path) -> None:
    """Move the finished directory `stage` to `out`, replacing what is there."""
    if not out.exists():
        os.replace(stage, out)
        return
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
    os.replace(out, old / "dir")
    os.replace(stage, out)
    shutil.rmtree(old)


def export(
    run: NotEmptyPath,
    format: Literal["hf", "gguf"],
    out: NotEmptyPath,
    outtype: Literal["f32", "f16", "bf16", "q8_0"] = "f32",
    overwrite: bool = False,
    no_verify: bool = False,
) -> Path:
    """Export a trained model to Hugging Face (transformers) or GGUF (llama.cpp).

    GPT-2-shaped models (learned positions, LayerNorm, GELU, biases) export as gpt2,
    Llama-shaped ones (rotary positions, RMSNorm, SwiGLU, no biases) as llama; a model with
    any other option (QK-norm, ReLU^2, soft-capped logits, post-norm, sinusoidal positions,
    ...) is refused with the options named and the flags that would export (see
    docs/export.md).

    Args:
        run: a run directory, or a model directory with config.json, model.safetensors and
            the tokenizer files (a LoRA run: its adapters merged over its base).
        format: hf (a directory for transformers) or gguf (one file for llama.cpp).
        out: the directory (hf) or file (gguf) to write.
        outtype: the weights' number format in the file, as llama.cpp's converter names it:
            f32, f16, bf16, or q8_0 (gguf only: blocks of 32 int8 values with an f16 scale).
        overwrite: replace an existing --out.
        no_verify: read the weights without checking them against the sizes and sha256
            digests that config.json records (for huge files).

    Returns:
        the path written.

    Raises:
        UserError / MissingFileError: an unknown format or outtype, --out exists without
            overwrite, the run has no weights or no tokenizer, the model has options neither
            format represents, or an outtype the format or the model cannot take.
    """
    if format not in FORMATS:
        raise UserError(f"unknown format {format!r}; use one of {list(FORMATS)}")
    if outtype not in DTYPES:
        raise UserError(f"unknown outtype {outtype!r}; use one of {list(DTYPES)}")
    if format == "hf" and outtype == "q8_0":
        raise UserError("q8_0 is a GGUF quantisation; a hf export takes f32, f16 or bf16")
    run, out = Path(run), Path(out)
    model = load_run(run, verify=not no_verify)
    arch = export_target(model.config, format)
    if format == "gguf":
        check_gguf_dtype(model.config, outtype)
    tokenizer = load_tokenizer(run)
    _check_out(out, run, format, overwrite)
    if format == "gguf":
        save_gguf(model, tokenizer, out, outtype)
    else:
        stage = make_temp_dir(out.parent, f".{out.name}.", ".tmp")
        try:
            save_hf(model, tokenizer, stage, outtype)
            _replace_dir(stage, out)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    print(f"exported {run} as {arch} ({format}, {outtype}) to {out}")
    return out
