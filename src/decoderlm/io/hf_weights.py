"""The weight files of a Hugging Face model directory: model.safetensors, a sharded
model.safetensors.index.json with its shards, or pytorch_model.bin (read as plain tensors,
never unpickling code), checked against the digests config.json records where it records
them (`decoderlm.io.hf_gpt2.save_gpt2` and `decoderlm.io.hf_llama.save_llama` write them).

Those exports also record, in model.safetensors' own metadata (which the recorded sha256
covers), the config.json entries that decide what the model computes (`weights_metadata`);
reading refuses a config.json whose entries differ from them (an edited n_head loads weights
of the same shapes and computes something else), digests checked or not."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import MissingFileError, UserError
from ..files import read_json
from ..model.weights import read_safetensors, recorded_digest, verify_file

__all__ = ["HF_WEIGHT_FILES", "hf_weight_files", "read_hf_weights", "weights_metadata"]

RECORDED_CONFIG = "decoderlm.config"  # model.safetensors' metadata entry of weights_metadata


def weights_metadata(hf_config: dict, keys: tuple[str, ...]) -> dict[str, str]:
    """model.safetensors' metadata for an export: {"format": "pt", "decoderlm.config": the
    JSON of `hf_config`'s entries named in `keys` (those it has)}."""
    recorded = {k: hf_config[k] for k in keys if k in hf_config}
    return {"format": "pt", RECORDED_CONFIG: json.dumps(recorded, sort_keys=True)}


def _check_recorded_config(path: Path, hf_config: dict) -> None:
    """UserError when `path`'s metadata records config.json entries that differ from
    `hf_config`'s (nothing recorded: a file from elsewhere, no check)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            text = (f.metadata() or {}).get(RECORDED_CONFIG)
    except Exception:  # unreadable: read_safetensors names the problem
        return
    try:
        recorded = json.loads(text) if text else {}
    except ValueError:
        recorded = None
    if not isinstance(recorded, dict):
        raise UserError(f"{path}: its {RECORDED_CONFIG!r} metadata is not a JSON object")
    changed = [
        f"{k}={hf_config.get(k)!r} (written with {v!r})"
        for k, v in recorded.items()
        if hf_config.get(k) != v
    ]
    if changed:
        raise UserError(
            f"{path.parent / 'config.json'} has {', '.join(changed)}: these weights were "
            f"exported for the values {path.name} records, and with others they compute "
            f"something else; restore config.json or export the model again"
        )


HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def hf_weight_files(directory: Path) -> list[Path]:
    """The files that hold a Hugging Face directory's weights, in the order they are read:
    [model.safetensors], [the index, its shards...] or [pytorch_model.bin].

    Raises:
        MissingFileError: none of them. UserError: an index without a weight_map.
    """
    index = directory / "model.safetensors.index.json"
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    if index.is_file():
        index_data = read_json(index)
        weight_map = index_data.get("weight_map") if isinstance(index_data, dict) else None
        if not isinstance(weight_map, dict):
            raise UserError(f"{index} has no weight_map")
        return [index, *(directory / shard for shard in sorted(set(weight_map.values())))]
    if (directory / "pytorch_model.bin").is_file():
        return [directory / "pytorch_model.bin"]
    raise MissingFileError(
        f"{directory} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


def read_hf_weights(directory: Path, hf_config: dict, verify: bool) -> dict[str, torch.Tensor]:
    """The tensors {file's name: tensor} of a Hugging Face directory's weight file(s); with
    verify, each file whose size and sha256 config.json["checksums"] records is checked first.

    Raises:
        MissingFileError: no weight file. UserError: a recorded digest differs, config.json
            differs from the entries model.safetensors records, or pytorch_model.bin is not
            plain tensors.
    """
    for name in ("model.safetensors", "pytorch_model.bin"):
        if verify and (directory / name).is_file():
            verify_file(
                directory / name, recorded_digest(hf_config, name, directory / "config.json")
            )
    if (directory / "model.safetensors").is_file():
        _check_recorded_config(directory / "model.safetensors", hf_config)
    files = hf_weight_files(directory)
    if files[0].name == "pytorch_model.bin":
        try:
            return torch.load(files[0], map_location="cpu", weights_only=True)
        except Exception as e:  # not a plain tensor file: refused, never executed
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(
                f"{files[0]} could not be read as plain tensors (torch.load "
                f"weights_only=True): {first_line}"
            ) from None
    shards = [f for f in files if f.name != "model.safetensors.index.json"]
    return {k: v for file in shards for k, v in read_safetensors(file).items()}
