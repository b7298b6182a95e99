"""Fine-tuning: where a run starts from, which parameters train, and adapters in and out.

`load_source` reads what `decoderlm train --init-from SRC` starts from: a decoderlm run or model
directory (config.json + model.safetensors, or an adapter directory), or a Hugging Face GPT-2
directory (config.json with model_type "gpt2" + model.safetensors or pytorch_model.bin, read
without unpickling code); it gives the model, its tokenizer and a record of the source (path,
kind, sha256 of the weight files) that the new run stores in config.json["init_from"].

`prepare_trainable` adds LoRA adapters (`decoderlm.lora`) and freezes parameters as a
`TrainConfig` asks. A run with adapters is saved as an adapter directory (see
`decoderlm.weights`); `load_model` loads any model directory, applying the adapters of an
adapter directory over its base, and `merge_run` writes an ordinary model directory from one.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from .config import ModelConfig, TrainConfig
from .files import make_temp_dir, read_json
from .hf import load_gpt2
from .lora import LoRALinear, apply_lora, is_lora_key, merge_lora, parse_targets
from .model import DecoderLM, RMSNorm
from .tokenizers import GPT2Tokenizer, Tokenizer, load_tokenizer
from .weights import ADAPTER_NAME, CONFIG_NAME, WEIGHTS_NAME, load_state, read_safetensors

__all__ = [
    "Source",
    "load_source",
    "load_model",
    "finetune_config",
    "prepare_trainable",
    "freeze",
    "trainable_counts",
    "merge_run",
    "lora_entry",
    "weights_sha256",
    "FREEZE_GROUPS",
]

FREEZE_GROUPS = ("embeddings", "head", "norms", "blocks", "blocks:I", "blocks:I-J")
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
        base = _adapter_config(directory)[1]
        return _sha256_of([directory / ADAPTER_NAME], base["sha256"])
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        return _sha256_of([index, *(directory / s for s in shards)])
    if (directory / "pytorch_model.bin").is_file():
        return _sha256_of([directory / "pytorch_model.bin"])
    raise FileNotFoundError(f"{directory} has no weight file")


def load_source(src: str | Path, map_location: str = "cpu") -> Source:
    """The model, tokenizer and source record of SRC for `decoderlm train --init-from SRC`.

    Raises:
        ValueError: SRC is not a model directory (the message says what one holds), its files
            are damaged or do not belong together, or it has no tokenizer.json (a decoderlm
            directory).
    """
    path = Path(src)
    config = read_json(path / CONFIG_NAME) if (path / CONFIG_NAME).is_file() else None
    if not path.is_dir() or not isinstance(config, dict):
        raise ValueError(f"--init-from {src} is not a model: {_NOT_A_MODEL}")
    if "model" in config:
        kind = "decoderlm"
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{src} has no tokenizer.json; a run directory saves its tokenizer")
        model, tokenizer = load_model(path, map_location), load_tokenizer(path)
    elif config.get("model_type") == "gpt2":
        kind = "gpt2"
        if not any((path / name).is_file() for name in _HF_WEIGHT_FILES):
            raise ValueError(f"--init-from {src} is not a model: {_NOT_A_MODEL}")
        model, tokenizer = load_gpt2(path, map_location), GPT2Tokenizer()
    elif "model_type" in config:
        raise ValueError(
            f"--init-from {src} is a Hugging Face {config['model_type']!r} model; only GPT-2 "
            f"checkpoints (model_type 'gpt2') and decoderlm runs can be fine-tuned"
        )
    else:
        raise ValueError(f"--init-from {src} is not a model: {_NOT_A_MODEL}")
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"the tokenizer of {src} has {tokenizer.vocab_size} tokens but its model expects "
            f"vocab_size={model.config.vocab_size}"
        )
    info = {"path": str(path.resolve()), "kind": kind, "sha256": weights_sha256(path)}
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
        raise ValueError(
            f"{'; '.join(clashes)}: with --init-from the model's shape comes from the source; "
            f"drop those flags (only --dropout and the training settings may change)"
        )
    return config


def _adapter_config(directory: Path) -> tuple[dict, dict, dict]:
    """(config.json, its "init_from", its "lora") of an adapter directory, checked."""
    config = read_json(directory / CONFIG_NAME)
    base = config.get("init_from") if isinstance(config, dict) else None
    lora = config.get("lora") if isinstance(config, dict) else None
    if not (isinstance(base, dict) and isinstance(lora, dict) and "model" in config):
        raise ValueError(
            f"{directory / CONFIG_NAME} lacks the 'model', 'init_from' or 'lora' entry that "
            f"an adapter directory's config.json has"
        )
    return config, base, lora


def load_model(directory: str | Path, map_location: str = "cpu", merge: bool = True) -> DecoderLM:
    """Load a model directory in eval mode; an adapter directory is loaded over its base.

    Args:
        directory: a model directory (`DecoderLM.from_pretrained`) or an adapter directory
            (a LoRA run or checkpoint: config.json with "lora" and "init_from" entries and
            adapter.safetensors).
        merge: fold the adapters into the weights (a plain DecoderLM whose logits equal the
            adapted model's); False keeps `LoRALinear` layers (for resuming training).

    Raises:
        FileNotFoundError / ValueError: missing or damaged files; the base model is missing or
            its weights changed since the adapters were trained (sha256 differs).
    """
    directory = Path(directory)
    if not (directory / ADAPTER_NAME).is_file():
        return DecoderLM.from_pretrained(directory, map_location)
    config, base_info, lora = _adapter_config(directory)
    base_path = Path(base_info["path"])
    if not base_path.is_dir():
        raise FileNotFoundError(
            f"the base model of {directory}, {base_path}, is missing; restore it there (its "
            f"weights' sha256 is {base_info['sha256']})"
        )
    base = load_source(base_path, map_location)
    if base.info["sha256"] != base_info["sha256"]:
        raise ValueError(
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
        raise ValueError(
            f"{directory / ADAPTER_NAME} does not match config.json's lora entry: missing "
            f"{sorted(expected - set(adapters))}, unexpected {sorted(set(adapters) - expected)}"
        )
    model.load_state_dict(adapters, strict=False)
    if merge:
        merge_lora(model)
    return model.to(map_location).eval()


def _freeze_group(model: DecoderLM, item: str) -> list[nn.Parameter]:
    """The parameters one --freeze item names (see `freeze`)."""
    if item == "embeddings":
        return [p for m in (model.tok_emb, model.pos_emb) if m is not None for p in m.parameters()]
    if item == "head":
        return [model.lm_head.weight]
    if item == "norms":
        norms = (nn.LayerNorm, RMSNorm)
        return [p for m in model.modules() if isinstance(m, norms) for p in m.parameters()]
    span = re.fullmatch(r"blocks(?::(\d+)(?:-(\d+))?)?", item)
    if span:
        n = len(model.blocks)
        first = int(span[1]) if span[1] else 0
        last = int(span[2]) if span[2] else (first if span[1] else n - 1)
        if not first <= last < n:
            raise ValueError(
                f"--freeze {item}: the model has {n} blocks, numbered 0 to {n - 1}; give "
                f"blocks:I-J with I <= J <= {n - 1}"
            )
        return [p for b in model.blocks[first : last + 1] for p in b.parameters()]
    if "*" in item or "." in item:
        named = model.named_parameters(remove_duplicate=False)
        return [p for name, p in named if fnmatch.fnmatchcase(name, item)]
    raise ValueError(
        f"--freeze {item!r} is not a group; use a comma-separated list of "
        f"{', '.join(FREEZE_GROUPS)} or parameter-name patterns such as blocks.*.attn.*"
    )


def freeze(model: DecoderLM, spec: str) -> int:
    """Set requires_grad=False on the parameters `spec` names: comma-separated items, each
    "embeddings" (tok_emb, pos_emb; with tied weights also the unembedding), "head"
    (lm_head), "norms" (every LayerNorm / RMSNorm), "blocks" (all), "blocks:I" or
    "blocks:I-J" (0-based, inclusive), or a parameter-name pattern with * (fnmatch).

    Returns:
        The number of parameter elements frozen by this call or earlier.

    Raises:
        ValueError: an item is not in the grammar, matches no parameter, or names blocks the
            model does not have.
    """
    for item in (i.strip() for i in spec.split(",")):
        if not item:
            continue
        found = _freeze_group(model, item)
        if not found:
            raise ValueError(
                f"--freeze {item!r} matches no parameter of this model (e.g. "
                f"{next(iter(dict(model.named_parameters())))})"
            )
        for p in found:
            p.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


def prepare_trainable(model: DecoderLM, cfg: TrainConfig) -> list[str]:
    """Add LoRA adapters (cfg.lora_rank; unless the model already has them) and freeze
    parameters (cfg.freeze) as cfg asks, in place. The new adapters' A matrices draw from
    torch's global RNG.

    Returns:
        The names of the adapted layers ([] without LoRA).

    Raises:
        ValueError: bad targets or freeze items (see `decoderlm.lora.apply_lora`, `freeze`),
            or nothing left to train.
    """
    adapted = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    if cfg.lora_rank is not None and not adapted:
        alpha = cfg.lora_alpha if cfg.lora_alpha is not None else float(cfg.lora_rank)
        adapted = apply_lora(
            model, cfg.lora_rank, alpha, parse_targets(cfg.lora_targets), cfg.lora_dropout
        )
    if cfg.freeze:
        freeze(model, cfg.freeze)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"--freeze {cfg.freeze} leaves no parameter to train")
    return adapted


def lora_entry(model: nn.Module, cfg: TrainConfig) -> dict | None:
    """config.json's "lora" entry of a model with adapters (None without): rank, alpha,
    dropout, targets (as given) and modules (the adapted layers' names)."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    if not layers:
        return None
    first = layers[0][1]
    return {
        "rank": first.rank,
        "alpha": first.alpha,
        "dropout": cfg.lora_dropout,
        "targets": cfg.lora_targets,
        "modules": [n for n, _ in layers],
    }


def trainable_counts(model: nn.Module) -> dict[str, int]:
    """{"total": unique parameters, "trainable": those with requires_grad, "adapters": LoRA
    parameters}."""
    params = list(model.parameters())
    return {
        "total": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "adapters": sum(p.numel() for n, p in model.named_parameters() if is_lora_key(n)),
    }


def merge_run(run: str | Path, out: str | Path) -> Path:
    """Write the model of adapter directory `run` with its adapters merged into the weights as
    an ordinary model directory `out` (model.safetensors, config.json, tokenizer.json), whose
    logits equal the adapted model's. config.json keeps the run's entries (its "train" without
    the LoRA settings) and adds "merged_from" {"run", "sha256"}. `out` appears complete or not
    at all.

    Raises:
        ValueError: `run` has no adapters, `out` exists and is not empty, or the run cannot be
            loaded (nothing is written then).
    """
    run, out = Path(run), Path(out)
    if not (run / ADAPTER_NAME).is_file() and not (run / WEIGHTS_NAME).is_file():
        raise ValueError(f"{run} is not a run directory (no {ADAPTER_NAME}); give a LoRA run")
    if not (run / ADAPTER_NAME).is_file():
        raise ValueError(
            f"{run} has no LoRA adapters (no {ADAPTER_NAME}); it is already an ordinary model "
            f"directory, usable as it is"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} already exists and is not empty; choose another --out")
    model, tokenizer = load_model(run), load_tokenizer(run)
    config, _, _ = _adapter_config(run)
    extra = {k: v for k, v in config.items() if k not in ("model", "lora")}
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
