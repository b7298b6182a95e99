"""`decoderlm export`: a trained model as a Hugging Face directory or a GGUF file.

`export(run, format, out, outtype, overwrite)` reads a run directory (or any model directory
`decoderlm.model.weights.save_model` wrote, with its tokenizer) and writes it in `format`:

    hf      a directory transformers' AutoModelForCausalLM and AutoTokenizer load with no extra
            arguments (`decoderlm.io.hf`)
    gguf    one GGUF file llama.cpp loads (`decoderlm.io.gguf`)

Which models export as which architecture: `decoderlm.io.targets`. The output appears whole
or not at all: a GGUF file is written under a temporary name, then renamed into place; a hf
export is written into a temporary folder beside --out, then renamed to --out, or, where --out
is an earlier hf export, its files moved in one by one (os.replace). An --out folder that holds
anything else is refused, never emptied; missing parent folders of --out are made (and said).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Literal

from ..arguments import NotEmptyPath
from ..errors import UserError
from ..files import fsync_dir, make_temp_dir
from ..model.weights import CONFIG_NAME
from .gguf import check_gguf_dtype, save_gguf
from .hf import HF_FILES, save_hf
from .load import check_flag_path, load_run, load_tokenizer
from .targets import DTYPES, FORMATS, export_target

__all__ = ["export"]


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return shown if len(names) <= 3 else f"{shown} and {len(names) - 3} more"


def _check_out(out: Path, run: Path, format: str, overwrite: bool) -> None:
    """UserError when `out` exists and may not (or cannot) be replaced: when it is the run
    directory `run`, a file or folder in it, or a folder above it (replacing it would destroy
    the model exported); a directory for gguf, a file for hf; for hf, a directory holding
    anything but the files a hf export writes (`HF_FILES`); and without `overwrite`. A new
    path inside `run` is allowed."""
    if not out.exists():
        return
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
    if format == "hf":
        others = sorted(
            p.name + ("/" if p.is_dir() else "")
            for p in out.iterdir()
            if p.name not in HF_FILES or not p.is_file()
        )
        if others:
            raise UserError(
                f"--out {out} holds {_listed(others)}, which a hf export does not write, "
                "so it is not replaced; export to a new or empty folder"
            )
    if not overwrite:
        raise UserError(f"--out {out} already exists; pass --overwrite to replace it")


def _make_folder(folder: Path, out: Path) -> Path | None:
    """Make `folder` with its missing parents; the outermost folder made (None when `folder`
    exists already). UserError when part of the path is a file."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    there = missing[-1].parent if missing else folder  # the nearest part that exists
    if not there.is_dir():
        raise UserError(f"--out {out}: {there} is a file, not a folder")
    if not missing:
        return None
    folder.mkdir(parents=True)
    return missing[-1]


def _move_files_in(stage: Path, out: Path) -> None:
    """Put the files of the finished hf directory `stage` in `out` and remove `stage`: a new
    `out` is `stage` renamed; into an existing one (holding only `HF_FILES`, see `_check_out`)
    each file is moved with os.replace, config.json last, and a file of an earlier export that
    this one did not write is removed. Nothing else in `out` is touched."""
    if not out.exists():
        os.replace(stage, out)
        return
    written = sorted((p.name for p in stage.iterdir()), key=lambda name: name == CONFIG_NAME)
    for name in written:
        os.replace(stage / name, out / name)
    for name in set(HF_FILES) - set(written):
        (out / name).unlink(missing_ok=True)
    stage.rmdir()
    fsync_dir(out)


def export(
    run: NotEmptyPath,
    format: Literal["hf", "gguf"],
    out: NotEmptyPath,
    outtype: Literal["f32", "f16", "bf16", "q8_0"] = "f32",
    overwrite: bool = False,
    no_verify: bool = False,
    base: NotEmptyPath | None = None,
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
        overwrite: replace an existing --out: a GGUF file, or the files of an earlier hf
            export (a folder holding anything else is refused).
        no_verify: read the weights without checking them against the sizes and sha256
            digests that config.json records (for huge files).
        base: a LoRA run's base model, where it has moved since the run was trained
            (default: where the run records it).

    Returns:
        the path written.

    Raises:
        UserError / MissingFileError: an unknown format or outtype, --out exists without
            overwrite, an --out folder holding files a hf export does not write, --run a
            folder inside a run directory, the run has no weights or no tokenizer, the model
            has options neither format represents, or an outtype the format or the model
            cannot take.
    """
    if format not in FORMATS:
        raise UserError(f"unknown format {format!r}; use one of {list(FORMATS)}")
    if outtype not in DTYPES:
        raise UserError(f"unknown outtype {outtype!r}; use one of {list(DTYPES)}")
    if format == "hf" and outtype == "q8_0":
        raise UserError("q8_0 is a GGUF quantisation; a hf export takes f32, f16 or bf16")
    run, out = Path(run), Path(out)
    check_flag_path("run", run)
    model = load_run(run, verify=not no_verify, base=base)
    arch = export_target(model.config, format)
    if format == "gguf":
        check_gguf_dtype(model.config, outtype)
    tokenizer = load_tokenizer(run)
    _check_out(out, run, format, overwrite)
    made = _make_folder(out.parent, out)
    try:
        if format == "gguf":
            save_gguf(model, tokenizer, out, outtype)
        else:
            stage = make_temp_dir(out.parent, f".{out.name}.", ".tmp")
            try:
                save_hf(model, tokenizer, stage, outtype)
                _move_files_in(stage, out)
            except BaseException:
                shutil.rmtree(stage, ignore_errors=True)
                raise
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    said = "" if made is None else f" (made the folder {out.parent})"
    print(f"exported {run} as {arch} ({format}, {outtype}) to {out}{said}")
    return out
