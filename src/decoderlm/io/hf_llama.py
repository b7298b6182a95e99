"""Hugging Face Llama-family checkpoints in and out: transformers' LlamaForCausalLM,
Qwen2ForCausalLM and MistralForCausalLM directories (`LLAMA_FAMILY`).

A Llama-shaped `DecoderLM` (rotary positions, RMSNorm, SwiGLU) is transformers' model with these
names (our rotary layout is its half-split one, so no permutation):

    tok_emb, ln_f, lm_head          -> model.embed_tokens, model.norm, lm_head
    blocks.i.ln_1, ln_2             -> model.layers.i.input_layernorm, post_attention_layernorm
    blocks.i.attn.qkv               -> model.layers.i.self_attn.q_proj, k_proj, v_proj (its
                                       rows split n_heads, n_kv_heads, n_kv_heads heads)
    blocks.i.attn.proj              -> model.layers.i.self_attn.o_proj
    blocks.i.mlp.gate, fc, proj     -> model.layers.i.mlp.gate_proj, up_proj, down_proj

config.json's fields, as `llama_config` reads them:

    num_key_value_heads, head_dim   n_kv_heads, head_dim (grouped-query attention)
    rope_theta + rope_scaling       rope_base, rope_scaling (rope_type or type "default" or
    (or rope_parameters, as         "llama3"; any other rotary scaling is refused)
    transformers 5 writes them)
    rms_norm_eps                    norm_eps
    tie_word_embeddings             tie_embeddings (also tied when the file has no lm_head)
    attention_bias, mlp_bias        Llama's q/k/v/o and MLP biases: bias=True, the biases the
                                    file lacks zeros (the same logits)
    (Qwen2)                         qkv_bias: q/k/v biases, no o bias
    sliding_window (Mistral; Qwen2  max_positions capped to the window, said once on stderr:
    with use_sliding_window)        within the window sliding-window attention is full
                                    attention
    max_position_embeddings         block_size (the rotary table and KV caches are this long)

Weights load into float32 whatever their stored dtype (bf16 and f16 checkpoints too), as
GPT-2's do. Meta's original checkpoints use the interleaved rotary layout instead; their q and
k rows are permuted by `decoderlm.model.positions.rope_interleaved_to_half`. The whole
directory with its tokenizer: `decoderlm.io.hf`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ROPE_SCALING_KEYS, ModelConfig
from ..errors import UserError
from ..files import atomic_write, read_json, write_json
from ..model.model import DecoderLM
from ..model.weights import CHECKSUMS_KEY, file_digest, load_state, unwrap_model
from .hf_weights import read_hf_weights, weights_metadata
from .targets import export_target

__all__ = ["LLAMA_FAMILY", "family_of", "llama_config", "load_llama", "save_llama"]

LLAMA_FAMILY = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
"""The Llama-family architectures (config.json's `architectures`) and their model_type."""

_LLAMA_BLOCK = {
    "ln_1.weight": "input_layernorm.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "attn.proj.bias": "self_attn.o_proj.bias",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.fc.weight": "mlp.up_proj.weight",
    "mlp.proj.weight": "mlp.down_proj.weight",
    "mlp.gate.bias": "mlp.gate_proj.bias",
    "mlp.fc.bias": "mlp.up_proj.bias",
    "mlp.proj.bias": "mlp.down_proj.bias",
}
_LLAMA_TOP = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "ln_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_QKV = ("q_proj", "k_proj", "v_proj")
_IGNORED = ("rotary_emb.inv_freq",)  # buffers older checkpoints hold, rebuilt from the config


def _qkv_rows(c: ModelConfig) -> tuple[int, int, int]:
    return (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim)


# the config.json entries that decide what the model computes, recorded in an export's
# model.safetensors (`weights_metadata`) and checked when it is read
COMPUTATION_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "sliding_window",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "tie_word_embeddings",
)


def _llama_state(model: DecoderLM) -> dict[str, torch.Tensor]:
    c, out = model.config, {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        parts = key.split(".")
        if parts[0] == "blocks":
            prefix, rest = f"model.layers.{parts[1]}.", ".".join(parts[2:])
            if rest in ("attn.qkv.weight", "attn.qkv.bias"):
                kind = parts[-1]
                for name, part in zip(_QKV, tensor.split(_qkv_rows(c)), strict=True):
                    out[f"{prefix}self_attn.{name}.{kind}"] = part.contiguous()
                continue
            out[prefix + _LLAMA_BLOCK[rest]] = tensor.contiguous()
        elif key == "ln_f.weight":
            out[_LLAMA_TOP[key]] = tensor.contiguous()
        elif key != "lm_head.weight" or not c.tie_embeddings:
            out[_LLAMA_TOP[key]] = tensor[: c.vocab_size].contiguous()  # padded rows cut
    return out


def _export_architecture(c: ModelConfig) -> str:
    """The model_type written: "qwen2" for q/k/v biases without others and Qwen2's head_dim,
    else "llama" (q/k/v biases then written as Llama's attention_bias, o_proj's zeros)."""
    plain_heads = c.head_dim * c.n_heads == c.d_model
    return "qwen2" if c.qkv_bias and not c.bias and plain_heads else "llama"


def _rope_fields(c: ModelConfig) -> dict:
    """config.json's rotary fields in both spellings (transformers 4's and 5's)."""
    scaling = dict(c.rope_scaling) if c.rope_scaling else None
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": c.rope_base}
    return {"rope_theta": c.rope_base, "rope_scaling": scaling, "rope_parameters": parameters}


def save_llama(model: DecoderLM, directory: str | Path, eos_token_id=None) -> str:
    """Write a Llama-shaped `model` as a transformers LlamaForCausalLM directory, or
    Qwen2ForCausalLM for q/k/v biases (config.json + model.safetensors, in the weights'
    dtype) with the same logits; grouped-query attention, any head_dim and Llama 3's rope
    scaling included. eos_token_id: an id or a list of ids. Returns the model_type written.

    Raises:
        UserError: the model is not Llama-shaped (see `decoderlm.io.targets`).
    """
    model = unwrap_model(model)
    c = model.config
    if export_target(c, "hf") != "llama":
        raise UserError("save_llama writes Llama-shaped models; this one is GPT-2-shaped")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = _llama_state(model)
    arch = _export_architecture(c)
    attention_bias = c.bias or (c.qkv_bias and arch == "llama")
    if attention_bias and not c.bias:  # Llama's attention_bias has an o_proj bias: zeros
        for i in range(c.n_layers):
            weight = state[f"model.layers.{i}.self_attn.o_proj.weight"]
            state[f"model.layers.{i}.self_attn.o_proj.bias"] = weight.new_zeros(c.d_model)
    fields = {
        "model_type": arch,
        "architectures": [next(k for k, v in LLAMA_FAMILY.items() if v == arch)],
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "max_position_embeddings": c.max_positions,
        "rms_norm_eps": c.norm_eps,
        **_rope_fields(c),
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": eos_token_id[0] if isinstance(eos_token_id, list) else eos_token_id,
        "eos_token_id": eos_token_id,
    }
    if arch == "llama":
        fields.update(head_dim=c.head_dim, attention_bias=attention_bias, mlp_bias=c.bias)
    else:
        fields.update(use_sliding_window=False, sliding_window=None)
    metadata = weights_metadata(fields, COMPUTATION_KEYS)
    atomic_write(directory / "model.safetensors", lambda tmp: save_file(state, tmp, metadata))
    digest = {"model.safetensors": file_digest(directory / "model.safetensors")}
    write_json(directory / "config.json", {**fields, CHECKSUMS_KEY: digest})
    return arch


def family_of(hf: dict, source) -> str:
    """The model_type ("llama" | "qwen2" | "mistral") of a Llama-family config.json: its
    `architectures` entry, else its model_type.

    Raises:
        UserError: another architecture (the message names the ones decoderlm runs).
    """
    names = hf.get("architectures") or []
    for name in names:
        if name in LLAMA_FAMILY:
            return LLAMA_FAMILY[name]
    if not names and hf.get("model_type") in LLAMA_FAMILY.values():
        return hf["model_type"]
    shown = ", ".join(names) or f"model_type {hf.get('model_type')!r}"
    raise UserError(
        f"{source} is a {shown} model; decoderlm runs {', '.join(LLAMA_FAMILY)} and GPT2LMHeadModel"
    )


def _rope(hf: dict, source) -> tuple[float, dict | None]:
    """(rope_base, rope_scaling) of config.json's rope_theta + rope_scaling or
    rope_parameters (transformers 5)."""
    parameters = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = parameters.get("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**scaling, **{k: v for k, v in parameters.items() if k != "rope_theta"}}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise UserError(
            f"{source}: rotary scaling {kind!r} is not one decoderlm has (it runs none and "
            f"Llama 3's 'llama3')"
        )
    missing = [k for k in ROPE_SCALING_KEYS[1:] if k not in merged]
    if missing:
        raise UserError(f"{source}: its llama3 rope scaling lacks {', '.join(missing)}")
    return float(theta), {"rope_type": "llama3", **{k: merged[k] for k in ROPE_SCALING_KEYS[1:]}}


def _window(hf: dict, family: str, source) -> int | None:
    """The sliding-window length config.json puts in use, or None."""
    window = hf.get("sliding_window")
    if family == "qwen2":
        layers = hf.get("layer_types") or []
        if not hf.get("use_sliding_window") and "sliding_attention" not in layers:
            return None
    if window is not None and not (isinstance(window, int) and window > 0):
        raise UserError(f"{source}: sliding_window must be a positive integer, got {window!r}")
    return window


def _refused(hf: dict, family: str) -> list[str]:
    """The config.json options decoderlm has no counterpart for, as "name=value"."""
    checks = [
        ("hidden_act", lambda v: v == "silu"),
        ("num_key_value_heads", lambda v: hf["num_attention_heads"] % v == 0),
    ]
    if family == "qwen2":
        checks.append(("head_dim", lambda v: v * hf["num_attention_heads"] == hf["hidden_size"]))
    return [f"{k}={hf[k]!r}" for k, ok in checks if hf.get(k) is not None and not ok(hf[k])]


def llama_config(hf: dict, source, has_lm_head: bool = True) -> ModelConfig:
    """The ModelConfig of a Llama-family config.json (see the module docstring).

    Args:
        hf: config.json's object.
        source: names the file in messages.
        has_lm_head: whether the weights hold lm_head.weight (tied when not).

    Raises:
        UserError: an architecture or an option decoderlm has not (one line naming it).
    """
    family = family_of(hf, source)
    refused = _refused(hf, family)
    if refused:
        raise UserError(f"{source}: options decoderlm has not: {', '.join(refused)}")
    rope_base, rope_scaling = _rope(hf, source)
    heads = hf["num_attention_heads"]
    positions = hf.get("max_position_embeddings", 2048)
    window = _window(hf, family, source)
    if window is not None and window < positions:
        print(
            f"note: {source} attends over a sliding window of {window} tokens; decoderlm "
            f"runs it with at most {window} positions (the same logits there)",
            file=sys.stderr,
        )
        positions = window
    biased = family == "llama" and bool(hf.get("attention_bias") or hf.get("mlp_bias"))
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        block_size=positions,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"],
        bias=biased,
        qkv_bias=family == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)) or not has_lm_head,
        pos_encoding="rope",
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp="swiglu",
    )


def _our_state(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(state under our names, our key -> the file's name) of a Llama-family file."""
    back = {v: k for k, v in _LLAMA_TOP.items()}
    block = {v: k for k, v in _LLAMA_BLOCK.items()}
    state, names, qkv = {}, {}, {}
    for name, tensor in tensors.items():
        if name.endswith(_IGNORED):
            continue
        parts = name.split(".")
        if name.startswith("model.layers.") and len(parts) > 5 and parts[4] in _QKV:
            qkv.setdefault((parts[2], parts[5]), {})[parts[4]] = tensor
            continue
        if name.startswith("model.layers."):
            key = f"blocks.{parts[2]}.{block.get('.'.join(parts[3:]), '.'.join(parts[3:]))}"
        else:
            key = back.get(name, name)
        state[key], names[key] = tensor, name
    for (layer, kind), found in qkv.items():
        key = f"blocks.{layer}.attn.qkv.{kind}"
        state[key] = torch.cat([found.get(n, torch.empty(0)) for n in _QKV])
        names[key] = f"model.layers.{layer}.self_attn.q_proj/k_proj/v_proj.{kind}"
    return state, names


def load_llama(directory: str | Path, map_location: str = "cpu", verify: bool = True) -> DecoderLM:
    """A transformers Llama, Qwen2 or Mistral directory as a DecoderLM in eval mode, float32
    (see the module docstring); with verify, a weights file whose sha256 and size
    config.json records (as `save_llama` writes) is checked first.

    Raises:
        MissingFileError: no config.json or weights.
        UserError: an architecture or options decoderlm has not, or tensors that do not fit
            the config (named in the message).
    """
    directory = Path(directory)
    hf = read_json(directory / "config.json")
    tensors = read_hf_weights(directory, hf, verify)
    config = llama_config(hf, directory / "config.json", "lm_head.weight" in tensors)
    state, names = _our_state(tensors)
    model = DecoderLM.unfilled(config)
    if config.bias:  # Llama's attention_bias / mlp_bias: the biases the file lacks are zeros
        for key, tensor in model.state_dict().items():
            if key.endswith(".bias"):
                state.setdefault(key, torch.zeros(tensor.shape))
    return load_state(model, state, directory, names).to(map_location).eval()
