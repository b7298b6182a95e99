"""Hugging Face GPT-2 checkpoints in and out.

A transformers GPT-2 directory holds config.json (model_type "gpt2": n_embd, n_layer, n_head,
n_positions, vocab_size, activation_function, layer_norm_epsilon, ...) and model.safetensors
(or pytorch_model.bin). Its names map onto `DecoderLM`'s:

    transformer.wte / wpe            -> tok_emb / pos_emb
    transformer.h.i.ln_1, ln_2       -> blocks.i.ln_1, ln_2
    transformer.h.i.attn.c_attn      -> blocks.i.attn.qkv      (Conv1D: weight is [in, out])
    transformer.h.i.attn.c_proj      -> blocks.i.attn.proj     (Conv1D)
    transformer.h.i.mlp.c_fc, c_proj -> blocks.i.mlp.fc, proj  (Conv1D)
    transformer.ln_f, lm_head        -> ln_f, lm_head

GPT-2's Conv1D stores y = x W + b with W [in, out], so exactly those four matrices per layer
are transposed for nn.Linear ([out, in]); older checkpoints' mask buffers (attn.bias,
attn.masked_bias) are ignored. transformers itself is needed only by the tests.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from ..errors import UserError
from ..files import atomic_write, read_json, write_json
from ..model.model import DecoderLM
from ..model.weights import CHECKSUMS_KEY, file_digest, load_state, unwrap_model
from .hf_weights import read_hf_weights, weights_metadata

__all__ = ["load_gpt2", "save_gpt2"]

_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
_BLOCK_NAMES = {
    "ln_1": "ln_1",
    "ln_2": "ln_2",
    "attn.c_attn": "attn.qkv",
    "attn.c_proj": "attn.proj",
    "mlp.c_fc": "mlp.fc",
    "mlp.c_proj": "mlp.proj",
}
_TOP_NAMES = {"wte": "tok_emb", "wpe": "pos_emb", "ln_f": "ln_f"}
# the config.json entries that decide what the model computes, recorded in an export's
# model.safetensors (`weights_metadata`) and checked when it is read
COMPUTATION_KEYS = (
    "vocab_size",
    "n_positions",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "activation_function",
    "layer_norm_epsilon",
    "tie_word_embeddings",
)
_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
}


def _config_from_hf(hf: dict, source: Path) -> ModelConfig:
    if not isinstance(hf, dict) or hf.get("model_type") != "gpt2":
        model_type = hf.get("model_type") if isinstance(hf, dict) else None
        raise UserError(f"{source} is not a GPT-2 config (model_type {model_type!r})")
    missing = [
        k for k in ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd") if k not in hf
    ]
    if missing:
        raise UserError(f"{source} lacks the GPT-2 fields {missing}")
    activation = _ACTIVATIONS.get(hf.get("activation_function", "gelu_new"))
    unsupported = [
        f"{k}={hf[k]!r}"
        for k, bad in (
            ("scale_attn_by_inverse_layer_idx", True),
            ("scale_attn_weights", False),
            ("add_cross_attention", True),
        )
        if k in hf and hf[k] == bad
    ]
    if activation is None:
        unsupported.insert(0, f"activation_function={hf.get('activation_function')!r}")
    if unsupported:
        raise UserError(f"{source}: unsupported GPT-2 options: {', '.join(unsupported)}")
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            block_size=hf["n_positions"],
            n_layers=hf["n_layer"],
            n_heads=hf["n_head"],
            d_model=hf["n_embd"],
            d_ff=hf.get("n_inner") or 4 * hf["n_embd"],
            dropout=hf.get("resid_pdrop") or 0.0,
            bias=True,
            tie_embeddings=hf.get("tie_word_embeddings", True),
            activation=activation,
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        )
    except (TypeError, ValueError) as e:
        raise UserError(
            f"{source}: {e} (GPT-2 names: n_positions = block_size, n_layer = "
            f"n_layers, n_head = n_heads, n_embd = d_model, resid_pdrop = dropout)"
        ) from None


def load_gpt2(
    directory: str | Path,
    map_location: str = "cpu",
    tie_embeddings: bool | None = None,
    vocab_size: int | None = None,
    padded_vocab_size: int | None = None,
    verify: bool = True,
) -> DecoderLM:
    """Load a transformers GPT-2 checkpoint directory as a DecoderLM (eval mode).

    Returns a model whose logits equal GPT2LMHeadModel's (tanh GELU, LayerNorm epsilon and
    tying as in config.json) over its vocab_size tokens; its `eos_token_id` is config.json's
    (GPT-2: 50256), where that is one of its ids.

    Args:
        directory: the checkpoint directory.
        map_location: the device to load onto.
        tie_embeddings: override config.json's tie_word_embeddings (see
            `DecoderLM.from_pretrained`); a tied model refuses a file whose
            transformer.wte.weight and lm_head.weight differ.
        vocab_size: the real vocabulary when the file's rows are padded (e.g. 50,257 for a
            nanoGPT export with 50,304 rows); the rows beyond it become padding. None: all
            of the file's rows are tokens.
        padded_vocab_size: pad the embedding and unembedding to this many rows (zeros; see
            `ModelConfig.padded_vocab_size`), e.g. 50,304 to train GPT-2 as nanoGPT does.
        verify: check the weights file against the size and sha256 that config.json's
            "checksums" entry records (written by `save_gpt2`; transformers' own directories
            record none and load unchecked); False skips the check.

    Raises:
        MissingFileError: no config.json or weights.
        UserError: not GPT-2, unsupported options, unreadable weight files, missing /
            unexpected / mis-shaped tensors (named in the message), conflicting tied weights,
            vocab_size / padded_vocab_size that do not fit the file's rows, or a weights file
            whose size or sha256 differs from the recorded one.
    """
    directory = Path(directory)
    hf_config = read_json(directory / "config.json")
    config = _config_from_hf(hf_config, directory / "config.json")
    state, file_keys = {}, {}
    for name, tensor in read_hf_weights(directory, hf_config, verify).items():
        key = name.removeprefix("transformer.")
        parts = key.split(".")
        if parts[0] == "h":
            module = ".".join(parts[2:-1])
            if module == "attn" and parts[-1] in ("bias", "masked_bias"):
                continue  # the causal-mask buffers of older checkpoints
            if module not in _BLOCK_NAMES:
                raise UserError(f"unexpected tensor {key!r} in {directory}")
            if module in _CONV1D and parts[-1] == "weight":
                tensor = tensor.t()
            key = f"blocks.{parts[1]}.{_BLOCK_NAMES[module]}.{parts[-1]}"
        elif parts[0] in _TOP_NAMES:
            key = f"{_TOP_NAMES[parts[0]]}.{parts[-1]}"
        elif key != "lm_head.weight":
            raise UserError(f"unexpected tensor {key!r} in {directory}")
        state[key], file_keys[key] = tensor.contiguous(), name
    if tie_embeddings is not None:
        config = dataclasses.replace(config, tie_embeddings=tie_embeddings)
    config, state = _with_vocab(config, state, vocab_size, padded_vocab_size)
    model = load_state(DecoderLM.unfilled(config), state, directory, file_keys)
    model.set_end_of_text(_eos_of(hf_config, config.vocab_size))
    return model.to(map_location).eval()


def _eos_of(hf_config: dict, vocab_size: int) -> int | None:
    """config.json's eos_token_id when it is one of the model's ids, else None."""
    eos = hf_config.get("eos_token_id")
    ok = isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < vocab_size
    return eos if ok else None


def _with_vocab(config: ModelConfig, state: dict, vocab_size, padded_vocab_size):
    """(config, state) with vocab_size tokens and padded_vocab_size rows: the embedding and
    unembedding cut or zero-padded to that many rows (only rows past vocab_size change)."""
    rows = config.vocab_size
    vocab_size = rows if vocab_size is None else vocab_size
    padded = rows if padded_vocab_size is None else padded_vocab_size
    if (
        isinstance(vocab_size, bool)
        or not isinstance(vocab_size, int)
        or not 0 < vocab_size <= rows
    ):
        raise UserError(
            f"vocab_size must be an integer from 1 to the file's {rows} rows, got {vocab_size!r}"
        )
    config = dataclasses.replace(
        config, vocab_size=vocab_size, padded_vocab_size=padded if padded != vocab_size else None
    )  # checks padded_vocab_size >= vocab_size
    for key in ("tok_emb.weight", "lm_head.weight"):
        if key in state and state[key].size(0) == rows != padded:
            table = state[key][: min(rows, padded)]
            state[key] = torch.cat([table, table.new_zeros(padded - len(table), table.size(1))])
    return config, state


def save_gpt2(model: DecoderLM, directory: str | Path, eos_token_id: int | None = None) -> None:
    """Write `model` as a transformers GPT-2 directory (config.json + model.safetensors) that
    `GPT2LMHeadModel.from_pretrained` loads with the same logits.

    A padded vocabulary is cut to its vocab_size real rows (transformers' GPT-2 has no
    padding; `load_gpt2(..., padded_vocab_size=N)` pads it again). config.json also records
    model.safetensors' sha256 and size under "checksums" (transformers keeps it as an unused
    attribute), which `load_gpt2` checks.

    Args:
        model: the DecoderLM (possibly wrapped).
        directory: where to write.
        eos_token_id: written as bos_token_id and eos_token_id; None: the model's
            `eos_token_id`, else GPT-2's <|endoftext|> (50256) when the vocabulary has that
            id, else null for both (no special token; an absent entry would make
            transformers assume 50256).

    Raises:
        UserError: the model is not GPT-2 shaped (needs pre-norm, learned positions,
            LayerNorm with bias, the GELU MLP with d_ff any width, no QK-norm, no logit
            soft-cap), or eos_token_id is not one of its ids.
    """
    model = unwrap_model(model)
    if eos_token_id is None:
        eos_token_id = getattr(model, "eos_token_id", None)
    c = model.config
    wrong = {
        k: getattr(c, k)
        for k, want in (
            ("norm_position", "pre"),
            ("pos_encoding", "learned"),
            ("norm", "layernorm"),
            ("mlp", "gelu"),
            ("bias", True),
            ("qk_norm", False),
            ("logit_softcap", None),
        )
        if getattr(c, k) != want
    }
    if wrong:
        raise UserError(f"only GPT-2-shaped models can be exported; this one has {wrong}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = {v: k for k, v in _BLOCK_NAMES.items()}
    out = {}
    for key, tensor in model.state_dict().items():
        parts = key.split(".")
        if parts[0] == "blocks":
            module = names[".".join(parts[2:-1])]
            if module in _CONV1D and parts[-1] == "weight":
                tensor = tensor.t()
            key = f"transformer.h.{parts[1]}.{module}.{parts[-1]}"
        elif key == "lm_head.weight":
            if c.tie_embeddings:
                continue
            tensor = tensor[: c.vocab_size]
        else:
            key = "transformer." + {v: k for k, v in _TOP_NAMES.items()}[parts[0]] + "." + parts[-1]
            tensor = tensor[: c.vocab_size] if parts[0] == "tok_emb" else tensor
        out[key] = tensor.detach().cpu().contiguous()
    hf = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": c.vocab_size,
        "n_positions": c.block_size,
        "n_ctx": c.block_size,  # what llama.cpp's convert_hf_to_gguf.py reads
        "n_embd": c.d_model,
        "n_layer": c.n_layers,
        "n_head": c.n_heads,
        "n_inner": None if c.d_ff == 4 * c.d_model else c.d_ff,
        "activation_function": "gelu_new" if c.activation == "gelu_tanh" else "gelu",
        "layer_norm_epsilon": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
        **_special_ids(c.vocab_size, eos_token_id),
    }
    metadata = weights_metadata(hf, COMPUTATION_KEYS)
    atomic_write(directory / "model.safetensors", lambda tmp: save_file(out, tmp, metadata))
    digest = file_digest(directory / "model.safetensors")
    write_json(directory / "config.json", {**hf, CHECKSUMS_KEY: {"model.safetensors": digest}})


def _special_ids(vocab_size: int, eos_token_id: int | None) -> dict:
    """config.json's bos_token_id / eos_token_id entries: eos_token_id, or GPT-2's 50256 when
    the vocabulary has it, else null (transformers' GPT2Config would otherwise assume 50256)."""
    if eos_token_id is None:
        eos = 50256 if vocab_size > 50256 else None
        return {"bos_token_id": eos, "eos_token_id": eos}
    if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int):
        raise UserError(f"eos_token_id must be an integer, got {eos_token_id!r}")
    if not 0 <= eos_token_id < vocab_size:
        raise UserError(f"eos_token_id {eos_token_id} is not in the vocabulary [0, {vocab_size})")
    return {"bos_token_id": eos_token_id, "eos_token_id": eos_token_id}
