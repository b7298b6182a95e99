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
# where the cost of the flags that export is measured (the default preset's ablation)
COSTS = "what they cost in validation loss: docs/export.md, 'Exporting the default preset'"
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
_LABELS = {"gpt2": "GPT-2", "llama": "Llama"}
_NAMES = {  # what each blocking option is called in messages, by the model's value
    "qk_norm": {True: "QK-norm"},
    "norm_position": {"post": "post-norm"},
    "mlp": {"gelu": "a GELU MLP", "swiglu": "a SwiGLU MLP", "relu2": "a ReLU^2 MLP"},
    "pos_encoding": {
        "learned": "learned positions",
        "rope": "rotary positions",
        "sinusoidal": "sinusoidal positions",
    },
    "norm": {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"},
    "bias": {True: "biases", False: "bias-free layers"},
    "activation": {"gelu": "the exact (erf) GELU"},
}
_ANY_VALUE = {  # names of the options blocking at any value they take
    "logit_softcap": "a logit soft-cap",
    "n_kv_heads": "grouped-query attention",
    "head_dim": "a head_dim other than d_model / n_heads",
    "qkv_bias": "q/k/v biases",
    "rope_scaling": "rope scaling",
}


def _flag(field: str, value) -> str:
    shown = {None: "none", True: "true", False: "false"}.get(value, value)
    return f"--{field.replace('_', '-')} {shown}"


def _flags(wrong: dict) -> str:
    return " ".join(_flag(k, v) for k, v in wrong.items())


def _mismatches(config: ModelConfig, fields: dict) -> dict:
    return {k: v for k, v in fields.items() if getattr(config, k) != v}


def _not_written(config: ModelConfig, arch: str, format: str) -> dict:
    """{field: the value the exporter writes} for the grouped-query options (n_kv_heads,
    head_dim, qkv_bias, rope_scaling) it does not write as `arch` in `format`: none for llama,
    which writes them all, but rope scaling for gguf's qwen2 (llama with q/k/v biases); all of
    them for gpt2."""
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


def _routes(config: ModelConfig, format: str) -> dict:
    """{architecture: {field: the value it needs} for the fields of `config` that differ},
    nearest architecture first."""
    found = {}
    for arch, (fields, _) in ARCHITECTURES.items():
        wrong = {**_mismatches(config, fields), **_not_written(config, arch, format)}
        if arch == "gpt2" and format == "gguf" and config.activation != "gelu_tanh":
            wrong["activation"] = "gelu_tanh"  # llama.cpp's GPT-2 GELU is the tanh one
        found[arch] = wrong
    return dict(sorted(found.items(), key=lambda item: len(item[1])))


def _blockers(config: ModelConfig, format: str) -> tuple[str, dict]:
    """(the nearest architecture, {field: the value it needs} for the fields that differ)."""
    return next(iter(_routes(config, format).items()))


def _lacks(config: ModelConfig, arch: str, wrong: dict, format: str) -> str:
    """e.g. "GPT-2 has no QK-norm (qk_norm=True), rotary positions (pos_encoding='rope')"."""
    shown = [k for k in wrong if not (k == "activation" and "mlp" in wrong)]  # the MLP's own
    names = []
    for k in shown:
        value = getattr(config, k)
        name = _NAMES[k].get(value) if k in _NAMES else None
        name = name or _ANY_VALUE.get(k, k)
        names.append(f"{name} ({k}={value!r})")
    who = "llama.cpp's GPT-2" if arch == "gpt2" and "activation" in shown else _LABELS[arch]
    return f"{who} has no {', '.join(names)}"


def export_target(config: ModelConfig, format: str) -> str:
    """The architecture ("gpt2" | "llama") a model of `config` exports as in `format`.

    Args:
        config: the model's ModelConfig.
        format: "hf" (transformers) or "gguf" (llama.cpp).

    Raises:
        UserError: an unknown format, or the model has options neither architecture has; the
            one-line message names, for each architecture, the options it lacks and the
            flags (or preset) that would export as it.
    """
    if format not in FORMATS:
        raise UserError(f"unknown export format {format!r}; use one of {list(FORMATS)}")
    routes = _routes(config, format)
    arch, wrong = next(iter(routes.items()))
    if not wrong:
        return arch
    lacks = "; ".join(_lacks(config, a, w, format) for a, w in routes.items())
    ways = []
    for a, w in routes.items():
        preset = f"--preset {ARCHITECTURES[a][1]}"
        if a == "gpt2" and format == "gguf":  # the gpt2-shaped preset has the exact GELU
            preset += f" {_flag('activation', 'gelu_tanh')}"
        ways.append(f"{_flags(w)} (or {preset}) to export as {a}")
    raise UserError(
        f"this model cannot be exported to {format}: {lacks}; so the file would compute "
        f"something else; train with {' or with '.join(ways)} ({COSTS})"
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
            reasons.append(f"{format}: {shown} (train with {_flags(wrong)} for {arch})")
    if not targets:
        routes = _routes(config, "gguf")  # what exports to both formats
        lacks = "; ".join(_lacks(config, a, w, "gguf") for a, w in routes.items())
        ways = " or ".join(f"{_flags(w)} (as {a})" for a, w in routes.items())
        return (
            f"export: this model is not exportable ({lacks}); training with {ways} would "
            f"export it to hf and gguf ({COSTS})"
        )
    archs = " / ".join(sorted(set(targets.values())))
    merged = "; its adapters merged into the weights" if adapters else ""
    source = f"(decoderlm export --run {run} --format {'|'.join(targets)} --out PATH{merged})"
    line = f"export: this model exports to {' and '.join(targets)} as {archs} {source}"
    return line + (f"; not to {'; '.join(reasons)}" if reasons else "")
