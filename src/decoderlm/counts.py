"""What a model costs: `decoderlm params` (parameters, FLOPs per token, memory, and what trains
under --freeze or LoRA adapters) and `decoderlm presets` (each preset with its parameter count).

Every count is the closed form of `decoderlm.model.analysis`, checked against the real modules
built on the meta device (no memory allocated).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .arguments import NotEmptyStr, PositiveInt
from .config import FinetuneConfig, ModelConfig
from .errors import one_of
from .files import json_text, read_settings
from .finetune.trainable import prepare_trainable, trainable_counts
from .model.analysis import count_parameters, flops_per_token, memory_bytes
from .model.lora import LoRALinear, lora_parameter_count
from .model.model import DecoderLM
from .options import DtypeName, canonical_dtype
from .presets import PRESETS, PresetName, get_preset

__all__ = ["list_presets", "params", "params_report", "params_table"]


def list_presets() -> int:
    """List the named presets.

    Each preset's name, parameter count (of its model with its own vocab_size), description
    and settings.

    Returns:
        0, the exit status.
    """
    for name, preset in PRESETS.items():
        if not preset.model:  # "finetune": the model comes from --init-from
            print(f"{name} (the model of --init-from SRC): {preset.description}")
            print(f"    train: {preset.train}")
            continue
        total = count_parameters(ModelConfig.from_dict(preset.model))["total"]
        print(f"{name} ({total:,} parameters): {preset.description}")
        print(f"    model: {preset.model}")
        if preset.train:
            print(f"    train: {preset.train}")
    return 0


def params(
    preset: PresetName | None = None,
    run: NotEmptyStr | None = None,
    model_config: NotEmptyStr | None = None,
    batch_size: PositiveInt = 1,
    seq_len: PositiveInt | None = None,
    dtype: DtypeName = "float32",
    json: bool = False,
    freeze: str | None = None,
    lora_rank: PositiveInt | None = None,
    lora_targets: str | None = None,
) -> int:
    """Parameter, FLOP and memory counts of a model.

    Closed-form parameter count (checked against a model built on the meta device), FLOPs
    per token and memory, from hyperparameters.

    Args:
        preset: the model of a preset (give one of --preset, --run, --model-config).
        run: the model of a run directory.
        model_config: a run's config.json, or ModelConfig fields in a YAML, JSON or TOML
            (.toml) file (optionally under `model`).
        batch_size: sequences per batch for the memory figures.
        seq_len: sequence length T (default: block_size).
        dtype: the number format for the memory figures (f32, bf16, f16, and fp32, fp16,
            are the same as float32, bfloat16, float16, here and in every command).
        json: print JSON instead of a table.
        freeze: count as trainable only what this --freeze of `decoderlm train` leaves
            (default: a run's own setting).
        lora_rank: count the parameters of LoRA adapters of this rank on --lora-targets,
            which alone train (default: a run's own setting).
        lora_targets: the layers with adapters (default: a run's, or qkv).

    Returns:
        0, the exit status.

    Raises:
        UserError / MissingFileError: not exactly one of preset, run and model_config; a
            missing or unreadable settings file; bad ModelConfig fields or freeze / LoRA
            settings.
    """
    one_of(preset=preset, run=run, model_config=model_config)
    saved = None
    if preset:
        config = ModelConfig.from_dict(get_preset(preset).model)
    else:
        path = Path(run or model_config)
        path = path / "config.json" if path.is_dir() else path
        data = read_settings(path, "--run" if run else "--model-config", "n_layers: 12")
        config = ModelConfig.from_dict(data.get("model", data))
        saved = data.get("train") if run and isinstance(data.get("train"), dict) else None
    given = {"freeze": freeze, "lora_rank": lora_rank, "lora_targets": lora_targets}
    report = params_report(config, batch_size, seq_len, dtype, given, saved)
    print(json_text(report) if json else params_table(report))
    return 0


def params_report(
    config: ModelConfig,
    batch_size: int = 1,
    seq_len: int | None = None,
    dtype: str = "float32",
    trainable: dict[str, Any] | None = None,
    saved: dict[str, Any] | None = None,
) -> dict:
    """The counts of `decoderlm params --json` for one model.

    Args:
        config: the model.
        batch_size, seq_len, dtype: of the memory figures (seq_len None: block_size).
        trainable: freeze / lora_rank / lora_targets settings (None values: `saved`'s).
        saved: a run's saved training settings (its config.json's "train").

    Returns:
        A dict: config, parameters (count_parameters), parameters_of_modules, vocabulary,
        flops_per_token (kaplan and palm), memory_bytes, memory_bytes_checkpointed,
        batch_size, seq_len, dtype, trainable (None when every parameter trains).

    Raises:
        RuntimeError: the closed form disagrees with the modules (a bug).
    """
    counts = count_parameters(config)
    with torch.device("meta"):  # the real modules, without allocating their memory
        built = DecoderLM(config).num_parameters()
    if built != counts["total"]:
        raise RuntimeError(f"internal error: formula {counts['total']} != modules {built}")
    T = seq_len or config.block_size
    return {
        "config": config.to_dict(),
        "parameters": counts,
        "parameters_of_modules": built,
        "vocabulary": {
            "tokens": config.vocab_size,
            "rows": config.vocab_rows,
            "padding_rows": config.vocab_rows - config.vocab_size,
        },
        "flops_per_token": {c: flops_per_token(config, T, c) for c in ("kaplan", "palm")},
        "memory_bytes": memory_bytes(config, batch_size, T, dtype),
        "memory_bytes_checkpointed": memory_bytes(config, batch_size, T, dtype, True),
        "batch_size": batch_size,
        "seq_len": T,
        "dtype": canonical_dtype(dtype),
        "trainable": _trainable_report(config, trainable or {}, saved),
    }


def _trainable_report(config: ModelConfig, given: dict, saved: dict | None) -> dict | None:
    """Trainable and total parameter counts under freeze / LoRA settings (`given`, else a
    run's saved `train` entry), from the real modules on the meta device; None when every
    parameter trains."""
    saved = saved if isinstance(saved, dict) else {}
    settings = {k: v if v is not None else saved.get(k) for k, v in given.items()}
    settings = {k: v for k, v in settings.items() if v is not None}
    if not settings.get("freeze") and not settings.get("lora_rank"):
        return None
    with torch.device("meta"):
        model = DecoderLM(config)
        prepare_trainable(model, FinetuneConfig(**settings))
    counts = trainable_counts(model)
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    shapes = [(m.out_features, m.in_features) for m in layers]
    closed_form = lora_parameter_count(shapes, settings.get("lora_rank") or 0)
    if counts["adapters"] != closed_form:
        raise RuntimeError(f"internal error: formula {closed_form} != adapters {counts}")
    return {**counts, "adapted_layers": len(layers), **settings}


def params_table(report: dict) -> str:
    """The report of `params_report` as text."""
    counts, built, T = report["parameters"], report["parameters_of_modules"], report["seq_len"]
    gib = 2**30
    lines = [
        f"parameters: {counts['total']:,} (modules on the meta device: {built:,}); "
        f"non-embedding (total minus the position table) {counts['non_embedding']:,}"
    ]
    lines += [
        f"  {part:<11} {counts[part]:>15,}"
        for part in ("embeddings", "attention", "mlp", "norms", "head")
    ]
    vocab = report["vocabulary"]
    if vocab["padding_rows"]:
        lines.append(
            f"vocabulary: {vocab['tokens']:,} tokens in {vocab['rows']:,} embedding rows "
            f"({vocab['padding_rows']:,} padding rows, counted above, never produced)"
        )
    k, p = report["flops_per_token"]["kaplan"], report["flops_per_token"]["palm"]
    lines.append(
        f"FLOPs per token at T={T}: forward {k['forward']:,}, training "
        f"{k['training']:,} (Kaplan: causal attention); PaLM convention (full T x T): "
        f"training {p['training']:,}; per sequence (Kaplan): training "
        f"{k['training_per_sequence']:,}"
    )
    m, c = report["memory_bytes"], report["memory_bytes_checkpointed"]
    lines.append(f"memory at batch {report['batch_size']}, T={T}, {report['dtype']}:")
    memory = ("weights", "gradients", "adamw", "activations", "training_total", "training_peak")
    lines += [
        f"  {key:<15} {m[key]:>16,} bytes = {m[key] / gib:9.3f} GiB"
        for key in (*memory, "kv_cache")
    ]
    lines.append(
        f"  activations with activation checkpointing: {c['activations'] / gib:.3f} GiB"
        f" (training total {c['training_total'] / gib:.3f} GiB)"
    )
    t = report.get("trainable")
    if t:
        adapters = (
            f"; LoRA adapters {t['adapters']:,} = r (d_in + d_out) summed over "
            f"{t['adapted_layers']} layers"
            if t["adapters"]
            else ""
        )
        lines.append(f"trainable: {t['trainable']:,} of {t['total']:,} parameters{adapters}")
    return "\n".join(lines)
