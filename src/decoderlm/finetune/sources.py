"""Where a fine-tuning run starts from, and loading a model directory with its adapters.

`load_source` reads what `decoderlm train --init-from SRC` starts from: a decoderlm run or model
directory (config.json + model.safetensors, or an adapter directory), or a Hugging Face GPT-2
directory (config.json with model_type "gpt2" + model.safetensors or pytorch_model.bin, read
without unpickling code); it gives the model, its tokenizer and a record of the source (path,
kind, sha256 of the weight files) that the new run stores in config.json["init_from"].
`load_model` loads any model directory, applying the adapters of an adapter directory (see
`decoderlm.model.weights`) over its base.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..config import ModelConfig
from ..errors import MissingFileError, UserError, checked_device, one_of
from ..files import read_json
from ..io.gguf import load_gguf
from ..io.hf import load_gpt2
from ..io.hf_export import load_hf
from ..model.analysis import out_of_memory_as_user_error
from ..model.lora import apply_lora, is_lora_key, merge_lora
from ..model.model import DecoderLM
from ..model.weights import (
    ADAPTER_NAME,
    CONFIG_NAME,
    WEIGHTS_NAME,
    load_state,
    read_safetensors,
    recorded_digest,
    verify_file,
)
from ..tokenizers import GPT2Tokenizer, Tokenizer, load_tokenizer

_HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


_NOT_A_MODEL = (
    "expected a decoderlm run directory (config.json with a 'model' entry and "
    "model.safetensors) or a Hugging Face GPT-2 directory (config.json and "
    "model.safetensors or pytorch_model.bin)"
)


@dataclass
class Source:
    """A model to start from: the DecoderLM (eval mode, adapters merged), its tokenizer, and
    info = {"path": resolved path, "kind": "decoderlm" | "gpt2", "sha256": of its weights}."""

    model: DecoderLM
    tokenizer: Tokenizer
    info: dict


def _sha256_of(paths: list[Path], extra: str = "") -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    digest.update(extra.encode())
    return digest.hexdigest()


def weights_sha256(directory: str | Path) -> str:
    """sha256 of the files that hold a model directory's weights: model.safetensors; an
    adapter directory's adapter.safetensors followed by its base's recorded sha256; a GPT-2
    directory's weight file (or index and shards).

    Raises:
        FileNotFoundError: no weight file.
    """
    directory = Path(directory)
    if (directory / WEIGHTS_NAME).is_file():
        return _sha256_of([directory / WEIGHTS_NAME])
    if (directory / ADAPTER_NAME).is_file():
        base = adapter_config(directory)[1]
        return _sha256_of([directory / ADAPTER_NAME], base["sha256"])
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        return _sha256_of([index, *(directory / s for s in shards)])
    if (directory / "pytorch_model.bin").is_file():
        return _sha256_of([directory / "pytorch_model.bin"])
    raise MissingFileError(f"{directory} has no weight file")


def load_source(src: str | Path, map_location: str = "cpu", verify: bool = True) -> Source:
    """The model, tokenizer and source record of SRC for `decoderlm train --init-from SRC`.
    verify: check the weight files against the digests config.json records (`load_model`).

    Raises:
        ValueError: SRC is not a model directory (the message says what one holds), its files
            are damaged or do not belong together, or it has no tokenizer.json (a decoderlm
            directory).
    """
    path = Path(src)
    config = read_json(path / CONFIG_NAME) if (path / CONFIG_NAME).is_file() else None
    if not path.is_dir() or not isinstance(config, dict):
        raise UserError(f"--init-from {src} is not a model: {_NOT_A_MODEL}")
    if "model" in config:
        kind = "decoderlm"
        if not (path / "tokenizer.json").is_file():
            raise UserError(f"{src} has no tokenizer.json; a run directory saves its tokenizer")
        model, tokenizer = load_model(path, map_location, verify=verify), load_tokenizer(path)
    elif config.get("model_type") == "gpt2":
        kind = "gpt2"
        if not any((path / name).is_file() for name in _HF_WEIGHT_FILES):
            raise UserError(f"--init-from {src} is not a model: {_NOT_A_MODEL}")
        model, tokenizer = load_gpt2(path, map_location, verify=verify), GPT2Tokenizer()
    elif "model_type" in config:
        raise UserError(
            f"--init-from {src} is a Hugging Face {config['model_type']!r} model; only GPT-2 "
            f"checkpoints (model_type 'gpt2') and decoderlm runs can be fine-tuned"
        )
    else:
        raise UserError(f"--init-from {src} is not a model: {_NOT_A_MODEL}")
    if tokenizer.vocab_size != model.config.vocab_size:
        raise UserError(
            f"the tokenizer of {src} has {tokenizer.vocab_size} tokens but its model expects "
            f"vocab_size={model.config.vocab_size}"
        )
    model.eos_token_id = tokenizer.eot_token
    # a digest the load has just checked is the file's: no second pass over a large file
    checked = recorded_digest(config, WEIGHTS_NAME, path / CONFIG_NAME) if verify else None
    use_recorded = checked is not None and kind == "decoderlm" and (path / WEIGHTS_NAME).is_file()
    sha256 = checked["sha256"] if use_recorded else weights_sha256(path)
    info = {"path": str(path.resolve()), "kind": kind, "sha256": sha256}
    return Source(model, tokenizer, info)


def finetune_config(source: ModelConfig, overrides: dict) -> ModelConfig:
    """The source's ModelConfig with `overrides` applied; only dropout may differ from it.

    Raises:
        ValueError: an override changes the model's shape (the message names each flag).
    """
    config = ModelConfig.from_dict({**source.to_dict(), **overrides})
    clashes = [
        f"--{k.replace('_', '-')} {overrides[k]} (the source has {k} {v!r})"
        for k, v in source.to_dict().items()
        if k != "dropout" and k in overrides and getattr(config, k) != v
    ]
    if clashes:
        raise UserError(
            f"{'; '.join(clashes)}: with --init-from the model's shape comes from the source; "
            f"drop those flags (only --dropout and the training settings may change)"
        )
    return config


def adapter_config(directory: Path) -> tuple[dict, dict, dict]:
    """(config.json, its "init_from", its "lora") of an adapter directory, checked."""
    config = read_json(directory / CONFIG_NAME)
    base = config.get("init_from") if isinstance(config, dict) else None
    lora = config.get("lora") if isinstance(config, dict) else None
    if not (isinstance(base, dict) and isinstance(lora, dict) and "model" in config):
        raise UserError(
            f"{directory / CONFIG_NAME} lacks the 'model', 'init_from' or 'lora' entry that "
            f"an adapter directory's config.json has"
        )
    return config, base, lora


def load_model(
    directory: str | Path, map_location: str = "cpu", merge: bool = True, verify: bool = True
) -> DecoderLM:
    """Load a model directory in eval mode; an adapter directory is loaded over its base.

    Args:
        directory: a model directory (`DecoderLM.from_pretrained`) or an adapter directory
            (a LoRA run or checkpoint: config.json with "lora" and "init_from" entries and
            adapter.safetensors).
        merge: fold the adapters into the weights (a plain DecoderLM whose logits equal the
            adapted model's); False keeps `LoRALinear` layers (for resuming training).
        verify: check model.safetensors (or adapter.safetensors, and the base's weights)
            against the size and sha256 that config.json records; False skips it. A
            directory that records none loads unchecked.

    Raises:
        FileNotFoundError / ValueError: missing or damaged files (a weights file whose size
            or sha256 differs from the recorded one: the message names it and both values);
            the base model is missing or its weights changed since the adapters were trained
            (sha256 differs).
    """
    directory = Path(directory)
    if not (directory / ADAPTER_NAME).is_file():
        return DecoderLM.from_pretrained(directory, map_location, verify=verify)
    config, base_info, lora = adapter_config(directory)
    base_path = Path(base_info["path"])
    if not base_path.is_dir():
        raise MissingFileError(
            f"the base model of {directory}, {base_path}, is missing; restore it there (its "
            f"weights' sha256 is {base_info['sha256']})"
        )
    if verify:
        recorded = recorded_digest(config, ADAPTER_NAME, directory / CONFIG_NAME)
        verify_file(directory / ADAPTER_NAME, recorded)
    base = load_source(base_path, map_location, verify)
    if base.info["sha256"] != base_info["sha256"]:
        raise UserError(
            f"the base model {base_path} changed since {directory} was trained from it (its "
            f"weights' sha256 differs); restore the original weights"
        )
    model = DecoderLM(ModelConfig.from_dict(config["model"]))
    if model.config.block_size < base.model.config.block_size:
        base.model.crop_block_size(model.config.block_size)  # trained on a cropped context
    load_state(model, base.model.state_dict(), base_path)
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
    return model.to(map_location).eval()


def check_vocab(tokenizer: Tokenizer, model, source) -> None:
    """ValueError unless the tokenizer has the model's vocab_size ids (they belong together)."""
    if tokenizer.vocab_size != model.config.vocab_size:
        raise UserError(
            f"the tokenizer of {source} has {tokenizer.vocab_size} tokens but the "
            f"model expects vocab_size={model.config.vocab_size}"
        )


def load_model_and_tokenizer(
    run: str | None,
    hf: str | None,
    device: str | None = "cpu",
    gguf: str | None = None,
    verify: bool = True,
) -> tuple[DecoderLM, Tokenizer]:
    """The model (eval mode) and tokenizer of `run` (a decoderlm run or model directory; an
    adapter directory is merged over its base), of `hf` (a Hugging Face GPT-2 or Llama
    directory, see `decoderlm.io.hf_export.load_hf`: its decoderlm tokenizer when `decoderlm
    export` wrote it, else GPT-2's BPE) or of `gguf` (a GGUF file, `decoderlm.io.gguf.load_gguf`);
    exactly one of them is given. The model's `eos_token_id` is the tokenizer's `eot_token`
    (None without one), where `generate` stops by default. verify: check the weight files
    against the digests config.json records (`load_model`; a GGUF file records none).

    Raises:
        UserError: none or several given, an unusable device, or the tokenizer's vocabulary
            does not fit the model, not enough memory to load it (one line with the
            estimate); MissingFileError / UserError from the loaders.
    """
    one_of(run=run, hf=hf, gguf=gguf)
    device = checked_device(device)
    flags = f"--run {run}" if run else ""
    with out_of_memory_as_user_error(f"load the model of {run or hf or gguf}", params_flags=flags):
        if hf:
            model, tokenizer = load_hf(hf, map_location=device, verify=verify)
        elif gguf:
            model, tokenizer = load_gguf(gguf, map_location=device, verify=verify)
        else:
            model = load_model(run, map_location=device, verify=verify)
            tokenizer = load_tokenizer(run)
    check_vocab(tokenizer, model, run or hf or gguf)
    model.eos_token_id = tokenizer.eot_token
    return model, tokenizer
