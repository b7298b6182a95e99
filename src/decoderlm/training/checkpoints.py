"""Resumable training checkpoints: <run>/checkpoints/step-NNNNNNNN/.

A checkpoint is a model directory (see `decoderlm.model.weights`) plus the tokenizer files and
trainer_state.pt (optimizer, step, RNG states, data sampler; only tensors and plain Python
containers, read back with torch.load(weights_only=True), so loading it never runs pickled
code). config.json records the sha256 and size of model.safetensors and trainer_state.pt,
and both are checked when the checkpoint is loaded (a damaged checkpoint is then skipped by
`decoderlm train --resume`, which falls back to the one before). It is written into a
hidden temporary directory, every file fsync-ed, then renamed into place: a crash while
writing leaves the previous checkpoints untouched and at most a `.tmp-*` directory, which is
ignored and cleaned up.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..errors import MissingFileError, UserError
from ..files import atomic_write, fsync_dir, make_temp_dir, read_json, torch_save
from ..model.weights import (
    _STEP_PREFIX,
    CHECKPOINTS_DIR,
    CHECKSUMS_KEY,
    CONFIG_NAME,
    file_digest,
    list_checkpoints,
    recorded_digest,
    save_weights,
    verify_file,
)

__all__ = ["save_checkpoint", "latest_checkpoint", "load_trainer_state", "TRAINER_STATE_NAME"]

TRAINER_STATE_NAME = "trainer_state.pt"


def save_checkpoint(run_dir: str | Path, step: int, files: dict[str, Any], keep: int) -> Path:
    """Write a complete checkpoint of optimizer step `step` atomically, then delete the
    oldest ones so that `keep` remain.

    Args:
        run_dir: the run directory; checkpoints go to run_dir/checkpoints/step-{step:08d}/.
        files: what goes in it: "model" -> (state dict, ModelConfig, extra config.json
            entries), "tokenizer" -> a tokenizer with save_pretrained (or None),
            "trainer_state" -> a dict of tensors and plain Python values.
        keep: how many checkpoints to keep (>= 1).

    Returns:
        The checkpoint directory.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_STEP_PREFIX}{step:08d}"
    tmp = make_temp_dir(root, f".tmp-{final.name}-")
    try:
        atomic_write(
            tmp / TRAINER_STATE_NAME, lambda path: torch_save(files["trainer_state"], path)
        )
        state, config, extra = files["model"]
        digest = {TRAINER_STATE_NAME: file_digest(tmp / TRAINER_STATE_NAME)}
        save_weights(state, config, tmp, {**(extra or {}), CHECKSUMS_KEY: digest})
        if files.get("tokenizer") is not None:
            files["tokenizer"].save_pretrained(tmp)
        if final.exists():  # the same step saved twice (e.g. interrupted right at the end)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # left by a crash during an earlier save
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest complete checkpoint of `run_dir`.

    Raises:
        FileNotFoundError: run_dir does not exist or holds no checkpoint.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MissingFileError(f"resume directory {run_dir} not found")
    found = list_checkpoints(run_dir)
    if not found:
        raise MissingFileError(
            f"{run_dir} holds no checkpoint (no {CHECKPOINTS_DIR}/"
            f"{_STEP_PREFIX}*/); nothing to resume; start a new run "
            f"without --resume"
        )
    return found[-1]


def load_trainer_state(checkpoint: str | Path, verify: bool = True) -> dict[str, Any]:
    """The trainer_state.pt of a checkpoint, read with torch.load(weights_only=True): a file
    that would need arbitrary unpickling is refused, never executed. With verify, the file is
    first checked against the size and sha256 that the checkpoint's config.json records
    (none recorded: no check).

    Raises:
        FileNotFoundError: the file is missing.
        UserError: the file is truncated, damaged (its size or sha256 differs from the
            recorded one) or holds something other than tensors and plain containers (the
            message names the file).
    """
    path = Path(checkpoint) / TRAINER_STATE_NAME
    if not path.is_file():
        raise MissingFileError(f"{path} not found; the checkpoint is incomplete")
    config_path = Path(checkpoint) / CONFIG_NAME
    if verify and config_path.is_file():
        verify_file(path, recorded_digest(read_json(config_path), TRAINER_STATE_NAME, config_path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, unsafe pickle, ...: all are "cannot use this file"
        raise UserError(
            f"{path} cannot be loaded safely ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); the checkpoint is "
            f"damaged or was not written by decoderlm"
        ) from None
    if not isinstance(state, dict) or "step" not in state:
        raise UserError(f"{path} is not a decoderlm trainer state (no 'step')")
    return state
