"""Configuration dataclasses.

`ModelConfig` fixes the shape of a `DecoderLM`; `TrainConfig` fixes how it is trained.
Both validate themselves on construction and raise `ValueError` naming the bad field, and
both round-trip through plain dicts (`to_dict` / `from_dict`), which is how they are stored
in a run directory's ``config.json``. The "Attributes:" sections of their docstrings are also
the help of the `decoderlm train` flags.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Literal

from .errors import UserError

__all__ = ["DTYPE_ALIASES", "DtypeName", "ModelConfig", "TrainConfig", "canonical_dtype"]


def _from_dict(cls, data: dict[str, Any]):
    """Build dataclass `cls` from `data`, refusing unknown keys with a clear message."""
    if not isinstance(data, dict):
        raise UserError(f"{cls.__name__} must be built from a dict, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise UserError(
            f"unknown {cls.__name__} field(s) {unknown}; known fields are {sorted(names)}"
        )
    return cls(**data)


def _check_int(obj, *names: str, low: int = 1, high: int | None = None) -> None:
    """Raise ValueError unless each named field is an integer in [low, high)."""
    for name in names:
        value = getattr(obj, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < low
            or (high is not None and value >= high)
        ):
            bound = "a positive integer" if low == 1 else f"an integer >= {low}"
            if high is not None:
                bound += f" below {high:,}"
            raise UserError(f"{name} must be {bound}, got {value!r}")


def _check_bool(obj, *names: str) -> None:
    """Raise ValueError unless each named field is True or False."""
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise UserError(f"{name} must be true or false, got {getattr(obj, name)!r}")


def _check_real(
    obj,
    name: str,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise ValueError unless getattr(obj, name) is a finite real number in the interval."""
    value = getattr(obj, name)
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and (value < high if high_open else value <= high)
    )
    if not ok:
        if high == math.inf:
            interval = f"{'>' if low_open else '>='} {low}"
        else:
            interval = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        hint = (
            " (a string: YAML reads 1e-3 as text; write 1.0e-3)" if isinstance(value, str) else ""
        )
        raise UserError(f"{name} must be a finite number {interval}, got {value!r}{hint}")


# the number formats: torch's names, and their short names (accepted everywhere, the same)
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DtypeName = Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]


def canonical_dtype(name: str) -> str:
    """torch's name of a number format: "bf16" -> "bfloat16", "float32" -> "float32", ...

    Raises:
        ValueError: not one of DtypeName.
    """
    if name not in typing.get_args(DtypeName):
        raise UserError(f"dtype must be one of {list(typing.get_args(DtypeName))}, got {name!r}")
    return DTYPE_ALIASES.get(name, name)


def _check_choices(obj) -> None:
    """Raise ValueError unless each field typed Literal[...] holds one of its values."""
    for name, hint in typing.get_type_hints(type(obj)).items():
        choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else None
        if choices and getattr(obj, name) not in choices:
            raise UserError(f"{name} must be one of {list(choices)}, got {getattr(obj, name)!r}")


@dataclass
class ModelConfig:
    """Hyperparameters of a decoder-only transformer (GPT-2 by default).

    Attributes:
        vocab_size: number of token ids; logits are [B, T, vocab_size]. `decoderlm train`
            takes the tokenizer's; a larger --vocab-size there becomes padded_vocab_size, a
            smaller one is refused.
        padded_vocab_size: rows of the token embedding and the unembedding when larger than
            vocab_size (e.g. 50,304 = 64 x 786 for GPT-2's 50,257 tokens, as nanoGPT pads
            for faster matmuls); None means vocab_size. The padded rows are never produced:
            the model drops their logits, so logits stay [B, T, vocab_size] and no sampling,
            loss or evaluation can meet a padded id.
        block_size: context length: the positions the model is trained on, and the most one
            forward pass may see with learned positions.
        max_positions: the most positions one forward pass (or one KV cache) may see; None
            means block_size. Sinusoidal and rotary positions are formulas, so "sinusoidal"
            and "rope" may take sequences longer than they were trained on, up to this
            limit (their tables are sized to it); generation slides its context only once
            it is reached. A learned table has block_size rows, so "learned" allows no more.
        n_layers: number of decoder blocks.
        n_heads: attention heads per block; head_dim = d_model / n_heads.
        d_model: width of the residual stream, x is [B, T, d_model].
        d_ff: hidden width of the MLP; None means 4 * d_model for "gelu" (GPT-2) and Llama's
            rule for "swiglu": 2/3 * 4 * d_model rounded up to a multiple of 256.
        dropout: dropout probability on embeddings, attention weights and residual branches
            (training mode only).
        embed_dropout, attn_dropout, resid_dropout: the dropout of one place instead of
            `dropout` (None: `dropout`): the embeddings (token + positions), the attention
            probabilities, the outputs of the attention and MLP branches.
        bias: whether Linear layers and LayerNorms carry a bias.
        tie_embeddings: share the unembedding matrix with the token embedding (GPT-2).
        pos_encoding: "learned" (GPT-2: a trained [block_size, d_model] table added to the
            token embeddings), "sinusoidal" (Vaswani et al. 2017, section 3.5: a fixed table,
            PE(pos, 2i) = sin(pos / 10000^(2i / d_model)), PE(pos, 2i+1) = cos(same), added)
            or "rope" (rotary, Su et al. 2021: q and k of every head rotated by position;
            the half-split layout of GPT-NeoX and Hugging Face Llama).
        rope_base: the rotary base theta (10,000 in Su et al. and Llama).
        norm_position: "pre" (GPT-2: x + f(norm(x)), plus a final norm) or "post" (Vaswani
            et al.: norm(x + f(x)), no final norm).
        norm: "layernorm" (Ba et al. 2016) or "rmsnorm" (Zhang & Sennrich 2019; no bias).
        norm_eps: epsilon of the norms.
        mlp: "gelu" (Linear -> activation -> Linear), "swiglu" (Shazeer 2020, as in Llama:
            proj(silu(gate(x)) * fc(x))) or "relu2" (proj(relu(fc(x))^2), the squared ReLU of
            So et al. 2021, "Primer", section 4; d_ff defaults to 4 * d_model).
        activation: the GELU of the "gelu" MLP: "gelu" is exact (erf), "gelu_tanh" is the tanh
            approximation GPT-2's released weights were trained with.
        qk_norm: RMS-normalise every head's q and k over head_dim (no gain) before rotary
            positions and the dot product (Henry et al. 2020, "Query-Key Normalization").
        zero_init_proj: initialise the residual output projections (attn.proj, mlp.proj)
            to zero, so every block starts as the identity (modded-nanogpt, nanochat).
        logit_softcap: None, or c > 0: logits become c * tanh(logits / c), bounded in
            (-c, c) (Gemma 2's final-logit soft-capping).

    Raises:
        ValueError: a size is not a positive integer, padded_vocab_size is below vocab_size,
            d_model is not divisible by n_heads,
            head_dim is odd with rope, max_positions is below block_size (or above it with
            learned positions), dropout is outside [0, 1), or an option is not one of
            its choices.
    """

    vocab_size: int = 50257
    padded_vocab_size: int | None = None
    block_size: int = 1024
    max_positions: int | None = None
    n_layers: int = 12
    n_heads: int = 12
    d_model: int = 768
    d_ff: int | None = None
    dropout: float = 0.0
    embed_dropout: float | None = None
    attn_dropout: float | None = None
    resid_dropout: float | None = None
    bias: bool = True
    tie_embeddings: bool = True
    pos_encoding: Literal["learned", "sinusoidal", "rope"] = "learned"
    rope_base: float = 10000.0
    norm_position: Literal["pre", "post"] = "pre"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    mlp: Literal["gelu", "swiglu", "relu2"] = "gelu"
    activation: Literal["gelu", "gelu_tanh"] = "gelu"
    qk_norm: bool = False
    zero_init_proj: bool = False
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_int(self, "vocab_size", "block_size", "n_layers", "n_heads", "d_model", high=2**31)
        if self.padded_vocab_size is not None:
            _check_int(self, "padded_vocab_size", high=2**31)
            if self.padded_vocab_size < self.vocab_size:
                raise UserError(
                    f"padded_vocab_size ({self.padded_vocab_size}) must be >= vocab_size "
                    f"({self.vocab_size}): padding only adds rows; leave it unset for none"
                )
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
            if self.mlp == "swiglu":
                self.d_ff = 256 * math.ceil(int(8 * self.d_model / 3) / 256)
        _check_int(self, "d_ff", high=2**31)
        if self.max_positions is None:
            self.max_positions = self.block_size
        _check_int(self, "max_positions", high=2**31)
        if self.max_positions < self.block_size:
            raise UserError(
                f"max_positions ({self.max_positions}) must be >= block_size "
                f"({self.block_size}); leave it unset to use block_size"
            )
        if self.pos_encoding == "learned" and self.max_positions > self.block_size:
            raise UserError(
                f"max_positions ({self.max_positions}) > block_size "
                f"({self.block_size}) needs pos_encoding 'sinusoidal' or 'rope': "
                f"a learned position table has only block_size rows"
            )
        if self.d_model % self.n_heads != 0:
            raise UserError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); "
                f"choose n_heads among the divisors of d_model"
            )
        if self.pos_encoding == "rope" and self.head_dim % 2:
            raise UserError(f"rope needs an even head_dim, got d_model / n_heads = {self.head_dim}")
        _check_real(self, "dropout", 0.0, 1.0, high_open=True)
        for name in ("embed_dropout", "attn_dropout", "resid_dropout"):
            if getattr(self, name) is not None:
                _check_real(self, name, 0.0, 1.0, high_open=True)
        _check_real(self, "rope_base", 1.0, low_open=True)
        _check_real(self, "norm_eps", 0.0, low_open=True)
        _check_bool(self, "bias", "tie_embeddings", "qk_norm", "zero_init_proj")
        if self.logit_softcap is not None:
            _check_real(self, "logit_softcap", 0.0, low_open=True)

    def dropout_at(self, place: Literal["embed", "attn", "resid"]) -> float:
        """The dropout probability of a place: its own field when set, else `dropout`."""
        own = getattr(self, f"{place}_dropout")
        return self.dropout if own is None else own

    @property
    def head_dim(self) -> int:
        """Width of one attention head: d_model // n_heads."""
        return self.d_model // self.n_heads

    @property
    def vocab_rows(self) -> int:
        """Rows of the token embedding and the unembedding: padded_vocab_size, or vocab_size."""
        return self.padded_vocab_size or self.vocab_size

    @property
    def length_limit(self) -> str:
        """The sequence-length limit for error messages: "block_size=N", or "max_positions=N"
        when that is larger."""
        if self.max_positions == self.block_size:
            return f"block_size={self.block_size}"
        return f"max_positions={self.max_positions}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return _from_dict(cls, data)


@dataclass
class TrainConfig:
    """How a model is trained.

    Attributes:
        batch_size: sequences per micro-batch and process; each is block_size + 1 contiguous
            tokens. An optimizer step sees batch_size * grad_accum_steps * world_size of them.
        grad_accum_steps: micro-batches whose gradients are summed (averaged) before each
            optimizer step.
        max_steps: optimizer steps.
        lr: peak learning rate of AdamW.
        min_lr: learning rate at the end of the cosine or warm-up-stable-decay schedule.
        warmup_steps: steps of linear warm-up from lr / warmup_steps to lr.
        decay_steps: the cosine decay reaches min_lr at this step and stays there; None
            means max_steps (nanoGPT's lr_decay_iters). Set it to stop a run early (max_steps)
            and resume it later on the same schedule.
        schedule: "cosine" (linear warm-up, then cosine decay to min_lr), "constant" (lr at
            every step, no warm-up) or "wsd" (warm-up-stable-decay, a trapezoid: linear
            warm-up, lr until the last cooldown_fraction of decay_steps, then linear decay to
            min_lr; Hu et al. 2024, "MiniCPM", section 4).
        cooldown_fraction: the share of decay_steps (default max_steps) that "wsd" spends
            decaying, in (0, 1].
        optimizer: "adamw" (every parameter) or "muon": torch.optim.Muon (Jordan et al. 2024;
            momentum, then the update orthogonalised by Newton-Schulz iterations) for the
            weight matrices of the Linear layers inside the blocks (attention and MLP), and
            AdamW for the rest (embeddings, unembedding, norm gains, biases). Muon's decoupled
            weight decay is weight_decay too. Not with fsdp or LoRA.
        muon_lr: Muon's peak learning rate (the schedule scales it like lr).
        muon_momentum: Muon's momentum coefficient (Nesterov).
        weight_decay: AdamW decoupled weight decay, applied to weight matrices and
            embeddings only (not to biases or LayerNorm gains).
        beta1: AdamW's first moment coefficient (of the gradient's running mean).
        beta2: AdamW's second moment coefficient (of the squared gradient's running mean).
        grad_clip: clip the global gradient norm to this value; None disables clipping.
        eval_interval: estimate the validation loss every this many steps (and at the end).
        eval_batches: each validation estimate during training covers at most eval_batches
            optimizer-step batches (batch_size * grad_accum_steps * world_size windows each)
            of non-overlapping windows, spread evenly over the validation split; the same
            windows however a step is split into micro-batches.
        log_interval: write a metrics line every this many steps.
        log: more places for the metrics.jsonl records: "csv" (metrics.csv) and/or
            "tensorboard" (event files in tensorboard/, tags train/loss, val/loss, train/lr,
            train/grad_norm, train/mfu, train/tokens_per_s, val/bpb; needs the optional
            tensorboard package); repeat the flag for both.
        peak_tflops: the device's peak TFLOP/s for the mfu metric (default: a table of
            known GPUs, or a matmul peak measured once on the CPU).
        dtype: "float32"; "bfloat16" for bfloat16 autocast; "float16" for float16 autocast
            with a GradScaler (dynamic loss scaling). Weights and optimizer state stay float32.
            "fp32", "bf16", "fp16" are the same (stored as the long names).
        compile: wrap the model in torch.compile for training.
        activation_checkpointing: recompute each block's activations in the backward pass
            instead of storing them (less memory, about 1/3 more compute).
        fsdp: with torchrun, shard parameters, gradients and optimizer state with FSDP2
            (torch.distributed.fsdp.fully_shard) instead of replicating them with DDP.
        checkpoint_interval: write a resumable checkpoint every this many steps (0: only at the
            end and when interrupted).
        keep_checkpoints: how many of the newest checkpoints to keep.
        val_fraction: fraction of the corpus held out for validation (the last part).
        seed: seeds torch for initialisation, batches and dropout.
        sample_chars: characters sampled into samples.txt after training.
        sample_prompt: prompt of that sample.
        freeze: parameters that do not train, a comma-separated list of groups: embeddings
            (token embedding, position table; with tie_embeddings also the unembedding),
            head (the unembedding), norms (every norm's gain and bias), blocks (all decoder
            blocks), blocks:I or blocks:I-J (blocks I to J inclusive, 0-based), or a
            parameter-name pattern with * (e.g. blocks.*.attn.*); None trains everything.
            The optimizer holds only the parameters that train.
        lora_rank: add LoRA adapters of this rank r (Hu et al. 2021) to the lora_targets
            layers and train only them (None: no adapters).
        lora_alpha: LoRA's alpha: the update is (alpha / r) B A; None means alpha = r.
        lora_targets: the linear layers that get adapters, comma-separated ends of module
            names: qkv, proj (attn.proj and mlp.proj), attn.proj, mlp.proj, fc, gate.
        lora_dropout: dropout probability on the adapters' input (training mode only).
    """

    batch_size: int = 32
    grad_accum_steps: int = 1
    max_steps: int = 400
    lr: float = 2e-4
    min_lr: float = 2e-5
    warmup_steps: int = 0
    decay_steps: int | None = None
    schedule: Literal["cosine", "constant", "wsd"] = "constant"
    cooldown_fraction: float = 0.2
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    weight_decay: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float | None = None
    eval_interval: int = 100
    eval_batches: int = 20
    log_interval: int = 10
    log: list[Literal["csv", "tensorboard"]] = dataclasses.field(default_factory=list)
    peak_tflops: float | None = None
    dtype: DtypeName = "float32"
    compile: bool = False
    activation_checkpointing: bool = False
    fsdp: bool = False
    checkpoint_interval: int = 500
    keep_checkpoints: int = 2
    val_fraction: float = 0.1
    seed: int = 1337
    sample_chars: int = 600
    sample_prompt: str = "T"
    freeze: str | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_targets: str = "qkv"
    lora_dropout: float = 0.0

    def __post_init__(self) -> None:
        _check_int(
            self,
            "batch_size",
            "grad_accum_steps",
            "max_steps",
            "eval_interval",
            "eval_batches",
            "log_interval",
            "keep_checkpoints",
        )
        _check_int(self, "warmup_steps", "sample_chars", "checkpoint_interval", low=0)
        _check_bool(self, "compile", "activation_checkpointing", "fsdp")
        if self.decay_steps is not None:
            _check_int(self, "decay_steps")
        _check_int(self, "seed", low=0, high=2**63)
        _check_choices(self)
        self.dtype = canonical_dtype(self.dtype)
        _check_real(self, "lr", 0.0, low_open=True)
        if self.schedule in ("cosine", "wsd"):
            _check_real(self, "min_lr", 0.0, self.lr)
        _check_real(self, "cooldown_fraction", 0.0, 1.0, low_open=True)
        _check_real(self, "muon_lr", 0.0, low_open=True)
        _check_real(self, "muon_momentum", 0.0, 1.0, high_open=True)
        if self.optimizer == "muon" and self.fsdp:
            raise UserError(
                "optimizer 'muon' orthogonalises whole weight matrices, which fsdp shards; "
                "use --fsdp false (DDP) or --optimizer adamw"
            )
        if self.optimizer == "muon" and self.lora_rank is not None:
            raise UserError(
                "optimizer 'muon' trains the blocks' weight matrices, which LoRA freezes; "
                "use --optimizer adamw with --lora-rank"
            )
        _check_real(self, "weight_decay", 0.0)
        _check_real(self, "beta1", 0.0, 1.0, high_open=True)
        _check_real(self, "beta2", 0.0, 1.0, high_open=True)
        if self.grad_clip is not None:
            _check_real(self, "grad_clip", 0.0, low_open=True)
        _check_real(self, "val_fraction", 0.0, 1.0, low_open=True, high_open=True)
        if self.peak_tflops is not None:
            _check_real(self, "peak_tflops", 0.0, low_open=True)
        if not isinstance(self.log, list) or not set(self.log) <= {"csv", "tensorboard"}:
            raise UserError(f"log must be a list of 'csv' and 'tensorboard', got {self.log!r}")
        if not isinstance(self.sample_prompt, str):
            raise UserError(f"sample_prompt must be text, got {self.sample_prompt!r}")
        self._check_finetuning()

    def _check_finetuning(self) -> None:
        """Raise ValueError for bad freeze / LoRA settings."""
        if self.lora_rank is not None:
            _check_int(self, "lora_rank", high=2**31)
        if self.lora_alpha is not None:
            _check_real(self, "lora_alpha", 0.0, low_open=True)
        _check_real(self, "lora_dropout", 0.0, 1.0, high_open=True)
        for name in ("freeze", "lora_targets"):
            value = getattr(self, name)
            if (value is not None or name == "lora_targets") and not (
                isinstance(value, str) and value.strip(", ")
            ):
                raise UserError(f"{name} must be a non-empty comma-separated list, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        return _from_dict(cls, data)
