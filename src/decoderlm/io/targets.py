"""Which models export to which format: `export_target` (one architecture, or a refusal naming
the options that block it) and `export_summary` (the line `decoderlm train` prints at its end).

Two architectures of other tools compute what a `DecoderLM` computes, option for option:

    gpt2    GPT-2 (transformers GPT2LMHeadModel, llama.cpp "gpt2"): learned positions,
            pre-norm LayerNorm with bias, GELU MLP, biases, tied or untied unembedding
    llama   Llama (transformers LlamaForCausalLM, llama.cpp "llama"): rotary positions,
            pre-norm RMSNorm, SwiGLU MLP, no biases, tied or untied unembedding

Any other option (QK-norm, ReLU^2, soft-capped logits, post-norm, sinusoidal positions, ...)
has no counterpart in them, so a file written anyway would load and compute something else:
such a model is refused, with the options that block it and the flags that would export.
llama.cpp's GPT-2 has the tanh GELU only, so a GPT-2-shaped model with the exact (erf) GELU
exports to hf but not to gguf. Grouped-query attention (n_kv_heads < n_heads), a head_dim
other than d_model / n_heads, q/k/v biases (as Qwen2ForCausalLM) and Llama 3's rope scaling
export to hf as Llama, and to gguf as llama (llama.cpp "llama": rope scaling as its
rope_freqs tensor) or, with q/k/v biases, as qwen2 (llama.cpp "qwen2", which has no rope
scaling: a model with both is refused for gguf).
"""

from __future__ import annotations

from ..config import ModelConfig
from ..errors import UserError

__all__ = ["ARCHITECTURES", "DTYPES", "FORMATS", "export_summary", "export_target"]

FORMATS = ("hf", "gguf")
DTYPES = ("f32", "f16", "bf16", "q8_0")
_COMMON = {"norm_position": "pre", "qk_norm": False, "logit_softcap": None}
ARCHITECTURES = {  # the ModelConfig fields each architecture fixes, and its preset
    "gpt2": (
        {**_COMMON, "pos_encoding": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True},
        "classic",
    ),
    "llama": (
        {**_COMMON, "pos_encoding": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False},
        "llama-tiny",
    ),
}
_NAMES = {  # what each blocking option is called in messages
    "qk_norm": "QK-norm",
    "logit_softcap": "logit soft-cap",
    "norm_position": "post-norm",
    "mlp": "MLP",
    "pos_encoding": "positions",
    "norm": "norm",
    "bias": "biases",
    "activation": "GELU",
    "n_kv_heads": "grouped-query attention",
    "head_dim": "head_dim",
    "qkv_bias": "q/k/v biases",
    "rope_scaling": "rope scaling",
}
_NOT_WRITTEN = ("n_kv_heads", "head_dim", "qkv_bias", "rope_scaling")  # see _not_written


def _flag(field: str, value) -> str:
    shown = {None: "none", True: "true", False: "false"}.get(value, value)
    return f"--{field.replace('_', '-')} {shown}"


def _mismatches(config: ModelConfig, fields: dict) -> dict:
    return {k: v for k, v in fields.items() if getattr(config, k) != v}


def _not_written(config: ModelConfig, arch: str, format: str) -> dict:
    """{field: the value the exporter writes} for the options it does not write yet (all of
    _NOT_WRITTEN but for llama, which writes them all; gguf's qwen2, for q/k/v biases, has
    no rope scaling)."""
    if arch == "llama" and (format == "hf" or not config.qkv_bias):
        return {}
    if arch == "llama":  # gguf's qwen2: no rope scaling
        return _mismatches(config, {"rope_scaling": None})
    plain = dict(
        n_kv_heads=config.n_heads,
        head_dim=config.d_model // config.n_heads,
        qkv_bias=False,
        rope_scaling=None,
    )
    return _mismatches(config, plain)


def _blockers(config: ModelConfig, format: str) -> tuple[str, dict]:
    """(the nearest architecture, {field: the value it needs} for the fields that differ)."""
    found = []
    for arch, (fields, _) in ARCHITECTURES.items():
        wrong = {**_mismatches(config, fields), **_not_written(config, arch, format)}
        if arch == "gpt2" and format == "gguf" and config.activation != "gelu_tanh":
            wrong["activation"] = "gelu_tanh"  # llama.cpp's GPT-2 GELU is the tanh one
        found.append((len(wrong), arch, wrong))
    _, arch, wrong = min(found, key=lambda item: item[0])
    return arch, wrong


def export_target(config: ModelConfig, format: str) -> str:
    """The architecture ("gpt2" | "llama") a model of `config` exports as in `format`.

    Args:
        config: the model's ModelConfig.
        format: "hf" (transformers) or "gguf" (llama.cpp).

    Raises:
        UserError: an unknown format, or the model has options neither architecture has; the
            one-line message names them and the preset or flags that would export.
    """
    if format not in FORMATS:
        raise UserError(f"unknown export format {format!r}; use one of {list(FORMATS)}")
    arch, wrong = _blockers(config, format)
    if not wrong:
        return arch
    options = ", ".join(f"{_NAMES[k]} ({k}={getattr(config, k)!r})" for k in wrong)
    flags = " ".join(_flag(k, v) for k, v in wrong.items())
    preset = f"--preset {ARCHITECTURES[arch][1]}"
    if arch == "gpt2" and format == "gguf":  # the gpt2-shaped preset has the exact GELU
        preset += f" {_flag('activation', 'gelu_tanh')}"
    verb = "has" if len(wrong) == 1 else "have"
    why = f"{verb} no counterpart in GPT-2 or Llama"
    if set(wrong) <= set(_NOT_WRITTEN):
        why = f"{'is' if len(wrong) == 1 else 'are'} not written by the exporters yet"
    raise UserError(
        f"this model cannot be exported to {format}: {options} {why}, so the "
        f"file would compute something else; train with {preset} "
        f"or with {flags} to export as {arch}"
    )


def export_summary(config: ModelConfig, run_dir=None, adapters: bool = False) -> str:
    """One line saying whether a model of `config` exports and to which formats, e.g.
    "export: this model exports to hf and gguf as gpt2 (decoderlm export --run DIR --format
    hf|gguf --out PATH)".

    Args:
        config: the model's ModelConfig.
        run_dir: the run directory, shown in the command (None: DIR).
        adapters: the run holds LoRA adapters, which the export merges into the weights it
            writes (as `decoderlm merge` does).
    """
    run = "DIR" if run_dir is None else str(run_dir)
    targets, reasons = {}, []
    for format in FORMATS:
        try:
            targets[format] = export_target(config, format)
        except UserError:
            arch, wrong = _blockers(config, format)
            shown = ", ".join(f"{k}={getattr(config, k)!r}" for k in wrong)
            flags = " ".join(_flag(k, v) for k, v in wrong.items())
            reasons.append(f"{format}: {shown} (train with {flags} for {arch})")
    if not targets:
        _, blocking = _blockers(config, "hf")
        _, wrong = _blockers(config, "gguf")  # the same, and the GELU llama.cpp's GPT-2 needs
        shown = ", ".join(f"{k}={getattr(config, k)!r}" for k in blocking)
        flags = " ".join(_flag(k, v) for k, v in wrong.items())
        why = "no counterpart in GPT-2 or Llama"
        if set(blocking) <= set(_NOT_WRITTEN):
            why = "not written by the exporters yet"
        return (
            f"export: this model is not exportable ({shown}: {why}); --preset classic or "
            f"llama-tiny, or {flags}, would export"
        )
    archs = " / ".join(sorted(set(targets.values())))
    merged = "; its adapters merged into the weights" if adapters else ""
    source = f"(decoderlm export --run {run} --format {'|'.join(targets)} --out PATH{merged})"
    line = f"export: this model exports to {' and '.join(targets)} as {archs} {source}"
    return line + (f"; not to {'; '.join(reasons)}" if reasons else "")
