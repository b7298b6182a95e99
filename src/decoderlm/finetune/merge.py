"""`merge_run`: a LoRA run's adapters folded into an ordinary model directory; `merge` is the
`decoderlm merge` command."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..arguments import NotEmptyStr
from ..errors import UserError
from ..files import make_temp_dir
from ..io.adapters import adapter_config
from ..io.load import load_model_and_tokenizer, weights_sha256
from ..model.weights import ADAPTER_NAME, CHECKSUMS_KEY, WEIGHTS_NAME

__all__ = ["merge", "merge_run"]


def merge(
    run: NotEmptyStr, out: NotEmptyStr, no_verify: bool = False, base: NotEmptyStr | None = None
) -> int:
    """Merge a LoRA run's adapters into an ordinary model directory.

    Write the model of a run trained with --lora-rank, its adapters folded into the weights
    (W + (alpha / r) B A), as a model directory (model.safetensors, config.json, the
    tokenizer files) whose logits equal the adapted model's; `sample`, `eval`, `serve` and
    the GPT-2 export take it without the base model.

    Args:
        run: the LoRA run (or one of its checkpoints); its base model is looked for where
            the run records it (relative to the run, then the absolute path).
        out: the new model directory (must not exist, or be empty).
        no_verify: load the weights without checking them against the sizes and sha256
            digests that config.json records (for huge files).
        base: the base model's directory, where it has moved since the run was trained.

    Returns:
        0, the exit status.

    Raises:
        UserError / MissingFileError: as `merge_run`.
    """
    written = merge_run(run, out, verify=not no_verify, base=base)
    files = "model.safetensors config.json tokenizer.json decoderlm_tokenizer.json"
    print(f"wrote {written}/: {files}")
    return 0


def merge_run(
    run: str | Path, out: str | Path, verify: bool = True, base: str | Path | None = None
) -> Path:
    """Write the model of adapter directory `run` with its adapters merged into the weights as
    an ordinary model directory `out` (model.safetensors, config.json, tokenizer.json), whose
    logits equal the adapted model's. config.json keeps the run's entries (its "train" without
    the LoRA settings) and adds "merged_from" {"run", "sha256"}. `out` appears complete or not
    at all. verify: check the weight files against their recorded digests (see
    `decoderlm.model.weights.verify_file`). base: the base model in a new place (see
    `decoderlm.io.adapters.checked_adapter_dir`).

    Raises:
        UserError / MissingFileError: `run` has no adapters, `out` exists and is not
            empty, or the run cannot be loaded (nothing is written then).
    """
    run, out = Path(run), Path(out)
    if not (run / ADAPTER_NAME).is_file() and not (run / WEIGHTS_NAME).is_file():
        raise UserError(f"{run} is not a run directory (no {ADAPTER_NAME}); give a LoRA run")
    if not (run / ADAPTER_NAME).is_file():
        raise UserError(
            f"{run} has no LoRA adapters (no {ADAPTER_NAME}); it is already an ordinary model "
            f"directory, usable as it is"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not empty; choose another --out")
    model, tokenizer = load_model_and_tokenizer(run, verify=verify, base=base)
    config, _, _ = adapter_config(run)
    extra = {k: v for k, v in config.items() if k not in ("model", "lora", CHECKSUMS_KEY)}
    if isinstance(extra.get("train"), dict):
        extra["train"] = {**extra["train"], "lora_rank": None, "lora_alpha": None}
    extra["merged_from"] = {"run": str(run.resolve()), "sha256": weights_sha256(run)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, f".tmp-{out.name}-")
    try:
        model.save_pretrained(tmp, extra)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
