"""Hugging Face Llama checkpoints in and out.

A Llama-shaped `DecoderLM` (rotary positions, RMSNorm, SwiGLU, no biases) is transformers'
LlamaForCausalLM with these names (our rotary layout is its half-split one, so no permutation):

    tok_emb, ln_f, lm_head          -> model.embed_tokens, model.norm, lm_head
    blocks.i.ln_1, ln_2             -> model.layers.i.input_layernorm, post_attention_layernorm
    blocks.i.attn.qkv               -> model.layers.i.self_attn.q_proj, k_proj, v_proj (split)
    blocks.i.attn.proj              -> model.layers.i.self_attn.o_proj
    blocks.i.mlp.gate, fc, proj     -> model.layers.i.mlp.gate_proj, up_proj, down_proj

Meta's original checkpoints use the interleaved rotary layout instead; their q and k rows are
permuted by `decoderlm.model.positions.rope_interleaved_to_half`. The whole directory with its
tokenizer: `decoderlm.io.hf`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from ..errors import UserError
from ..files import atomic_write, read_json, write_json
from ..model.model import DecoderLM
from ..model.weights import CHECKSUMS_KEY, file_digest, load_state, unwrap_model
from .hf_weights import read_hf_weights, weights_metadata
from .targets import export_target

__all__ = ["load_llama", "save_llama"]

_LLAMA_BLOCK = {
    "ln_1.weight": "input_layernorm.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.fc.weight": "mlp.up_proj.weight",
    "mlp.proj.weight": "mlp.down_proj.weight",
}
_LLAMA_TOP = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "ln_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_QKV = ("q_proj", "k_proj", "v_proj")
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
            if rest == "attn.qkv.weight":
                for name, part in zip(_QKV, tensor.split(c.d_model), strict=True):
                    out[f"{prefix}self_attn.{name}.weight"] = part.contiguous()
                continue
            out[prefix + _LLAMA_BLOCK[rest]] = tensor.contiguous()
        elif key == "ln_f.weight":
            out[_LLAMA_TOP[key]] = tensor.contiguous()
        elif key != "lm_head.weight" or not c.tie_embeddings:
            out[_LLAMA_TOP[key]] = tensor[: c.vocab_size].contiguous()  # padded rows cut
    return out


def save_llama(model: DecoderLM, directory: str | Path, eos_token_id: int | None = None) -> None:
    """Write a Llama-shaped `model` as a transformers LlamaForCausalLM directory
    (config.json + model.safetensors, in the weights' dtype) with the same logits.

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
    hf = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_positions,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
    }
    metadata = weights_metadata(hf, COMPUTATION_KEYS)
    atomic_write(directory / "model.safetensors", lambda tmp: save_file(state, tmp, metadata))
    digest = file_digest(directory / "model.safetensors")
    write_json(directory / "config.json", {**hf, CHECKSUMS_KEY: {"model.safetensors": digest}})


def load_llama(directory: str | Path, map_location: str = "cpu", verify: bool = True) -> DecoderLM:
    """A transformers Llama directory (no grouped-query attention, no rope scaling, no biases)
    as a DecoderLM in eval mode; with verify, a weights file whose sha256 and size config.json
    records (as `save_llama` writes) is checked first.

    Raises:
        MissingFileError: no config.json or weights.
        UserError: options decoderlm has not, or tensors that do not fit the config.
    """
    directory = Path(directory)
    hf = read_json(directory / "config.json")
    heads = hf["num_attention_heads"]
    unsupported = [
        f"{k}={hf[k]!r}"
        for k, ok in (
            ("num_key_value_heads", lambda v: v in (None, heads)),
            ("hidden_act", lambda v: v == "silu"),
            ("attention_bias", lambda v: not v),
            ("mlp_bias", lambda v: not v),
            ("rope_scaling", lambda v: not v or v.get("rope_type", v.get("type")) == "default"),
        )
        if hf.get(k) is not None and not ok(hf[k])
    ]
    if unsupported:
        raise UserError(f"{directory}: Llama options decoderlm has not: {', '.join(unsupported)}")
    rope = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    config = ModelConfig(
        vocab_size=hf["vocab_size"],
        block_size=hf["max_position_embeddings"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"],
        bias=False,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        pos_encoding="rope",
        rope_base=float(rope),
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp="swiglu",
    )
    back = {v: k for k, v in {**_LLAMA_TOP}.items()}
    block = {v: k for k, v in _LLAMA_BLOCK.items()}
    state, qkv = {}, {}
    for name, tensor in read_hf_weights(directory, hf, verify).items():
        parts = name.split(".")
        if name.startswith("model.layers."):
            rest = ".".join(parts[3:])
            if parts[4] in _QKV:
                qkv.setdefault(parts[2], {})[parts[4]] = tensor
                continue
            state[f"blocks.{parts[2]}.{block.get(rest, rest)}"] = tensor
        else:
            state[back.get(name, name)] = tensor
    for layer, parts in qkv.items():
        state[f"blocks.{layer}.attn.qkv.weight"] = torch.cat(
            [parts.get(n, torch.empty(0)) for n in _QKV]
        )
    return load_state(DecoderLM(config), state, directory).to(map_location).eval()
