"""The weight files of a Hugging Face model directory: model.safetensors, a sharded
model.safetensors.index.json with its shards, or pytorch_model.bin (read as plain tensors,
never unpickling code), checked against the digests config.json records where it records
them (`decoderlm.io.hf_gpt2.save_gpt2` and `decoderlm.io.hf_llama.save_llama` write them)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import MissingFileError, UserError
from ..files import read_json
from ..model.weights import read_safetensors, recorded_digest, verify_file

__all__ = ["HF_WEIGHT_FILES", "hf_weight_files", "read_hf_weights"]

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
        MissingFileError: no weight file. UserError: a recorded digest differs, or
            pytorch_model.bin is not plain tensors.
    """
    for name in ("model.safetensors", "pytorch_model.bin"):
        if verify and (directory / name).is_file():
            verify_file(
                directory / name, recorded_digest(hf_config, name, directory / "config.json")
            )
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
