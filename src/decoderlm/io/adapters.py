"""Adapter directories: a LoRA run or checkpoint, which holds its adapters alone
(adapter.safetensors) and records its base model in config.json ("init_from": the base's path
and weights' sha256; "lora": rank, alpha, modules, dropout; "model": the ModelConfig trained).

`adapter_config` reads and checks that record; `adapted_model` builds the model from a loaded
base and the adapters (see `decoderlm.model.lora`). Loading the base and checking it is the
one the adapters were trained on: `decoderlm.io.load.load_run`.
"""

from __future__ import annotations

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

__all__ = ["adapted_model", "adapter_config", "checked_adapter_dir", "is_adapter_dir"]


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


def checked_adapter_dir(directory: str | Path, verify: bool = True) -> tuple[dict, dict, dict]:
    """`adapter_config` of `directory` once its base model's directory is there and (with
    verify) adapter.safetensors matches the size and sha256 config.json records.

    Raises:
        MissingFileError: the base model (a directory or GGUF file) is missing (the message
            gives its sha256).
        UserError: as `adapter_config`; adapter.safetensors differs from its record.
    """
    directory = Path(directory)
    config, base_info, lora = adapter_config(directory)
    base_path = Path(base_info["path"])
    if base_path.is_absolute() and not base_path.exists():  # a Hub id is not a local path
        raise MissingFileError(
            f"the base model of {directory}, {base_path}, is missing; restore it there (its "
            f"weights' sha256 is {base_info['sha256']})"
        )
    if verify:
        recorded = recorded_digest(config, ADAPTER_NAME, directory / CONFIG_NAME)
        verify_file(directory / ADAPTER_NAME, recorded)
    return config, base_info, lora


def adapted_model(
    directory: Path, config: dict, lora: dict, base: DecoderLM, merge: bool = True
) -> DecoderLM:
    """The model of adapter directory `directory` (its `adapter_config` entries `config` and
    `lora`): the weights of `base` (cropped to the context trained, when shorter) with the
    LoRA adapters of adapter.safetensors; merge folds them into the weights (a plain
    DecoderLM whose logits equal the adapted model's), False keeps `LoRALinear` layers.

    Raises:
        UserError: base's weights do not fit config["model"], or adapter.safetensors' tensors
            are not the ones the lora entry asks for (missing and unexpected named).
    """
    model = DecoderLM(ModelConfig.from_dict(config["model"]))
    if model.config.block_size < base.config.block_size:
        base.crop_block_size(model.config.block_size)  # trained on a cropped context
    load_state(model, base.state_dict(), Path(config["init_from"]["path"]))
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
