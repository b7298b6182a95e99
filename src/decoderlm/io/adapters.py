"""Adapter directories: a LoRA run or checkpoint, which holds its adapters alone
(adapter.safetensors) and records its base model in config.json ("init_from": the base's
absolute path, its path relative to the run directory where the base lies inside the run's
parent directory or the working directory it was trained from, and its weights' sha256;
"lora": rank, alpha, modules, dropout; "model": the ModelConfig trained).

`adapter_config` reads and checks that record; `base_record` writes its paths;
`checked_adapter_dir` finds the base (`--base PATH`, else the relative path, else the
absolute one), so a project folder moved with its runs and base inside still loads;
`adapted_model` builds the model from a loaded base and the adapters (see
`decoderlm.model.lora`). Loading the base and checking it is the one the adapters were
trained on: `decoderlm.io.load.load_run`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..config import ModelConfig
from ..errors import MissingFileError, UserError
from ..files import read_json
from ..model.lora import apply_lora, is_lora_key, merge_lora
from ..model.model import DecoderLM
from ..model.weights import (
    ADAPTER_NAME,
    CONFIG_NAME,
    load_state,
    read_safetensors,
    recorded_digest,
    verify_file,
)

__all__ = [
    "adapted_model",
    "adapter_config",
    "base_record",
    "checked_adapter_dir",
    "find_base",
    "is_adapter_dir",
    "BaseModelError",
]


class BaseModelError(UserError):
    """A LoRA run's base model is missing or is not the one it was trained from: a fault of
    the run's surroundings, not of the directory loaded (a resume does not set it aside)."""


def is_adapter_dir(directory: str | Path) -> bool:
    """Whether `directory` holds LoRA adapters (adapter.safetensors) rather than a model."""
    return (Path(directory) / ADAPTER_NAME).is_file()


def adapter_config(directory: str | Path) -> tuple[dict, dict, dict]:
    """(config.json, its "init_from", its "lora") of an adapter directory, checked.

    Raises:
        MissingFileError: no config.json. UserError: it lacks one of the three entries.
    """
    directory = Path(directory)
    config = read_json(directory / CONFIG_NAME)
    base = config.get("init_from") if isinstance(config, dict) else None
    lora = config.get("lora") if isinstance(config, dict) else None
    if not (isinstance(base, dict) and isinstance(lora, dict) and "model" in config):
        raise UserError(
            f"{directory / CONFIG_NAME} lacks the 'model', 'init_from' or 'lora' entry that "
            f"an adapter directory's config.json has"
        )
    return config, base, lora


def base_record(info: dict, run_dir: str | Path) -> dict:
    """config.json["init_from"] of a run in `run_dir` that starts from the model `info`
    records ({"path": absolute, "kind", "sha256"}): info with "relative_path", the base's
    path relative to run_dir, where the base lies under run_dir's parent directory or under
    the working directory that holds run_dir (neither the file system's root); without one
    where it lies elsewhere."""
    record = {k: v for k, v in info.items() if k != "relative_path"}
    base, run, cwd = Path(info["path"]).resolve(), Path(run_dir).resolve(), Path.cwd().resolve()
    roots = [run.parent, *([cwd] if run.is_relative_to(cwd) else [])]
    if any(base.is_relative_to(r) for r in roots if r != Path(r.anchor)):
        record["relative_path"] = Path(os.path.relpath(base, run)).as_posix()
    return record


def _run_root(directory: Path) -> Path:
    """The run directory of an adapter directory: itself, or the run that holds it as
    checkpoints/step-N (or damaged-step-N)."""
    if directory.parent.name == "checkpoints" and re.fullmatch(
        r"(damaged-)?step-\d+(-\d+)?", directory.name
    ):
        return directory.parent.parent
    return directory


def _base_location(directory: Path, base_info: dict, base: str | Path | None) -> Path:
    """The base model's directory: `base` (--base), else the recorded relative path, else
    the absolute one, the first that is a directory.

    Raises:
        BaseModelError (also a MissingFileError): none is (one line naming the recorded path
            and --base).
    """
    if base is not None:
        if not Path(base).exists():
            raise MissingBaseError(
                f"--base {base} does not exist; give the directory (or GGUF file) of "
                f"{directory}'s base model (its weights' sha256 is {base_info['sha256']})"
            )
        return Path(base)
    relative = base_info.get("relative_path")
    candidates = [_run_root(directory) / relative] if isinstance(relative, str) else []
    for candidate in [*candidates, Path(base_info["path"])]:
        if candidate.exists():
            return candidate
    stored = f" (recorded as {relative} from the run)" if isinstance(relative, str) else ""
    raise MissingBaseError(
        f"the base model of {directory}, {base_info['path']}{stored}, is missing; give its "
        f"new place with --base PATH, or restore it there (its weights' sha256 is "
        f"{base_info['sha256']})"
    )


class MissingBaseError(BaseModelError, MissingFileError):
    """The base model of a LoRA run is not where the run (or --base) says."""


def find_base(directory: str | Path, base: str | Path | None = None) -> Path | None:
    """The base model's directory of adapter directory `directory` (see `checked_adapter_dir`);
    None where `directory` holds no adapters or its config.json cannot be read (the loader
    then says why).

    Raises:
        BaseModelError: the base model is missing.
    """
    directory = Path(directory)
    if not is_adapter_dir(directory):
        return None
    try:
        _, base_info, _ = adapter_config(directory)
    except UserError:
        return None
    return _base_location(directory, base_info, base)


def checked_adapter_dir(
    directory: str | Path, verify: bool = True, base: str | Path | None = None
) -> tuple[dict, dict, dict]:
    """`adapter_config` of `directory` once its base model's directory is found (see the
    module docstring; `base` overrides the record) and (with verify) adapter.safetensors
    matches the size and sha256 config.json records. The "init_from" returned has "path"
    the directory found.

    Raises:
        MissingFileError: the base model is missing (the message names the recorded path,
            --base and the base's sha256).
        UserError: as `adapter_config`; adapter.safetensors differs from its record.
    """
    directory = Path(directory)
    config, base_info, lora = adapter_config(directory)
    found = _base_location(directory, base_info, base)
    if verify:
        recorded = recorded_digest(config, ADAPTER_NAME, directory / CONFIG_NAME)
        verify_file(directory / ADAPTER_NAME, recorded)
    return config, {**base_info, "path": str(found)}, lora


def adapted_model(
    directory: Path,
    config: dict,
    lora: dict,
    base: DecoderLM,
    merge: bool = True,
    base_path: str | Path | None = None,
) -> DecoderLM:
    """The model of adapter directory `directory` (its `adapter_config` entries `config` and
    `lora`): the weights of `base` (cropped to the context trained, when shorter) with the
    LoRA adapters of adapter.safetensors; merge folds them into the weights (a plain
    DecoderLM whose logits equal the adapted model's), False keeps `LoRALinear` layers.
    base_path: where base was read (named in errors; default the recorded path).

    Raises:
        UserError: base's weights do not fit config["model"], or adapter.safetensors' tensors
            are not the ones the lora entry asks for (missing and unexpected named).
    """
    model = DecoderLM(ModelConfig.from_dict(config["model"]))
    if model.config.block_size < base.config.block_size:
        base.crop_block_size(model.config.block_size)  # trained on a cropped context
    load_state(model, base.state_dict(), Path(base_path or config["init_from"]["path"]))
    apply_lora(model, lora["rank"], lora["alpha"], lora["modules"], lora.get("dropout", 0.0))
    adapters = read_safetensors(directory / ADAPTER_NAME)
    expected = {k for k in model.state_dict() if is_lora_key(k)}
    if set(adapters) != expected:
        raise UserError(
            f"{directory / ADAPTER_NAME} does not match config.json's lora entry: missing "
            f"{sorted(expected - set(adapters))}, unexpected {sorted(set(adapters) - expected)}"
        )
    model.load_state_dict(adapters, strict=False)
    if merge:
        merge_lora(model)
    return model
