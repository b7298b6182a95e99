"""Configuration dataclasses.

`ModelConfig` fixes the shape of a `DecoderLM`; `TrainConfig` fixes how it is trained, in
sections (`DataConfig`, `OptimConfig`, `StepsConfig`, `EvalConfig`, `LoggingConfig`,
`CheckpointConfig`, `ComputeConfig`, `FinetuneConfig`, `ArtifactsConfig`). They validate
themselves on construction and raise `UserError` naming the bad field, and round-trip through
plain dicts (`to_dict` / `from_dict`), which is how they are stored in a run directory's
``config.json``. Each field's documentation (ModelConfig's "Attributes:" section, the
docstring under each field of a TrainConfig section) is also the help of its
`decoderlm train` flag.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Literal

from .errors import UserError
from .options import TrainDtypeName, canonical_dtype

__all__ = [
    "ArtifactsConfig",
    "CheckpointConfig",
    "ComputeConfig",
    "DataConfig",
    "EvalConfig",
    "FinetuneConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "StepsConfig",
    "TrainConfig",
]


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
    """Raise UserError unless each named field is an integer in [low, high)."""
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
    """Raise UserError unless each named field is True or False."""
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
    """Raise UserError unless getattr(obj, name) is a finite real number in the interval."""
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


ROPE_SCALING_KEYS = (
    "rope_type",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


def _check_rope_scaling(scaling, pos_encoding: str) -> None:
    """Raise UserError unless `scaling` is Llama 3's rope_scaling (see ModelConfig) with rope."""
    example = (
        '{"rope_type": "llama3", "factor": 32, "low_freq_factor": 1, "high_freq_factor": 4, '
        '"original_max_position_embeddings": 8192}'
    )
    if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
        kind = scaling.get("rope_type") if isinstance(scaling, dict) else scaling
        raise UserError(
            f"rope_scaling supports Llama 3's scaling only (rope_type 'llama3'), got "
            f"{kind!r}; give {example} or none"
        )
    if pos_encoding != "rope" or set(scaling) != set(ROPE_SCALING_KEYS):
        problem = (
            f"needs pos_encoding 'rope', not {pos_encoding!r}"
            if pos_encoding != "rope"
            else f"needs exactly the keys {list(ROPE_SCALING_KEYS)}, got {sorted(scaling)}"
        )
        raise UserError(f"rope_scaling {problem}; e.g. {example}")
    numbers = {k: scaling[k] for k in ROPE_SCALING_KEYS[1:]}
    ok = all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        for v in numbers.values()
    )
    low, high = numbers["low_freq_factor"], numbers["high_freq_factor"]
    if not ok or numbers["factor"] < 1 or high <= low:
        raise UserError(
            f"rope_scaling's numbers must be positive with factor >= 1 and high_freq_factor > "
            f"low_freq_factor, got {numbers}; e.g. {example}"
        )


def _check_choices(obj) -> None:
    """Raise UserError unless each field typed Literal[...] holds one of its values."""
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
        n_heads: query heads per block.
        n_kv_heads: key and value heads per block (grouped-query attention, Ainslie et al.
            2023: query head h reads key/value head h // (n_heads / n_kv_heads), as Hugging
            Face's repeat_kv); None means n_heads (multi-head attention), 1 is multi-query
            attention (Shazeer 2019). Must divide n_heads. KV caches hold n_kv_heads heads.
        head_dim: width of one attention head; None means d_model / n_heads. Any positive
            value (even with rope) otherwise: the fused qkv projection is d_model ->
            (n_heads + 2 n_kv_heads) head_dim and attn.proj is n_heads head_dim -> d_model,
            so d_model need not equal n_heads head_dim.
        d_model: width of the residual stream, x is [B, T, d_model].
        d_ff: hidden width of the MLP; None means 4 * d_model for "gelu" (GPT-2) and Llama's
            rule for "swiglu": 2/3 * 4 * d_model rounded up to a multiple of 256.
        dropout: dropout probability on embeddings, attention weights and residual branches
            (training mode only).
        embed_dropout: dropout on the embeddings (token + positions) instead of `dropout`
            (None: `dropout`).
        attn_dropout: dropout on the attention probabilities instead of `dropout` (None:
            `dropout`).
        resid_dropout: dropout on the outputs of the attention and MLP branches instead of
            `dropout` (None: `dropout`).
        bias: whether Linear layers and LayerNorms carry a bias.
        qkv_bias: the fused q/k/v projection carries a bias even when bias is false, and the
            attention's output projection follows bias (Qwen2: q, k and v biases, none
            elsewhere).
        tie_embeddings: share the unembedding matrix with the token embedding (GPT-2).
        pos_encoding: "learned" (GPT-2: a trained [block_size, d_model] table added to the
            token embeddings), "sinusoidal" (Vaswani et al. 2017, section 3.5: a fixed table,
            PE(pos, 2i) = sin(pos / 10000^(2i / d_model)), PE(pos, 2i+1) = cos(same), added)
            or "rope" (rotary, Su et al. 2021: q and k of every head rotated by position;
            the half-split layout of GPT-NeoX and Hugging Face Llama).
        rope_base: the rotary base theta (10,000 in Su et al. and Llama).
        rope_scaling: None, or Llama 3's static rescaling of the rotary inverse frequencies
            (the same at every length), a JSON object {"rope_type": "llama3", "factor": 32,
            "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings":
            8192} (Llama 3.2's values): wavelengths above original / low_freq_factor are
            divided by factor, those below original / high_freq_factor kept, and those
            between interpolated (transformers' _compute_llama3_parameters). Rope only.
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
        UserError: a size is not a positive integer, padded_vocab_size is below vocab_size,
            d_model is not divisible by n_heads (head_dim unset), n_kv_heads does not divide
            n_heads, head_dim is odd with rope, rope_scaling is not Llama 3's (or is set
            without rope), max_positions is below block_size (or above it with
            learned positions), dropout is outside [0, 1), or an option is not one of
            its choices.
    """

    vocab_size: int = 50257
    padded_vocab_size: int | None = None
    block_size: int = 1024
    max_positions: int | None = None
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_model: int = 768
    d_ff: int | None = None
    dropout: float = 0.0
    embed_dropout: float | None = None
    attn_dropout: float | None = None
    resid_dropout: float | None = None
    bias: bool = True
    qkv_bias: bool = False
    tie_embeddings: bool = True
    pos_encoding: Literal["learned", "sinusoidal", "rope"] = "learned"
    rope_base: float = 10000.0
    rope_scaling: dict | None = None
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
        self._check_heads()
        _check_real(self, "dropout", 0.0, 1.0, high_open=True)
        for name in ("embed_dropout", "attn_dropout", "resid_dropout"):
            if getattr(self, name) is not None:
                _check_real(self, name, 0.0, 1.0, high_open=True)
        _check_real(self, "rope_base", 1.0, low_open=True)
        _check_real(self, "norm_eps", 0.0, low_open=True)
        _check_bool(self, "bias", "qkv_bias", "tie_embeddings", "qk_norm", "zero_init_proj")
        if self.logit_softcap is not None:
            _check_real(self, "logit_softcap", 0.0, low_open=True)
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling, self.pos_encoding)

    def _check_heads(self) -> None:
        """Resolve n_kv_heads and head_dim (None: n_heads, d_model / n_heads) and check them."""
        if self.head_dim is None:
            if self.d_model % self.n_heads != 0:
                raise UserError(
                    f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); "
                    f"choose n_heads among the divisors of d_model, or set head_dim"
                )
            self.head_dim = self.d_model // self.n_heads
        _check_int(self, "head_dim", high=2**31)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        _check_int(self, "n_kv_heads", high=2**31)
        if self.n_heads % self.n_kv_heads:
            raise UserError(
                f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads}): each "
                f"key/value head serves n_heads / n_kv_heads query heads"
            )
        if self.pos_encoding == "rope" and self.head_dim % 2:
            raise UserError(f"rope needs an even head_dim, got head_dim = {self.head_dim}")

    def dropout_at(self, place: Literal["embed", "attn", "resid"]) -> float:
        """The dropout probability of a place: its own field when set, else `dropout`."""
        own = getattr(self, f"{place}_dropout")
        return self.dropout if own is None else own

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
class DataConfig:
    """What each optimizer step trains on, and the split it is measured on."""

    batch_size: int = 32
    """Sequences per micro-batch and process; each is block_size + 1 contiguous tokens. An
    optimizer step sees batch_size * grad_accum_steps * world_size of them."""
    grad_accum_steps: int = 1
    """Micro-batches whose gradients are summed (averaged) before each optimizer step."""
    val_fraction: float = 0.1
    """Fraction of the corpus held out for validation (the last part)."""
    seed: int = 1337
    """Seeds torch for initialisation, batches and dropout."""

    def __post_init__(self) -> None:
        _check_int(self, "batch_size", "grad_accum_steps")
        _check_int(self, "seed", low=0, high=2**63)
        _check_real(self, "val_fraction", 0.0, 1.0, low_open=True, high_open=True)


@dataclass
class OptimConfig:
    """The optimizer: its kind, peak learning rates, weight decay, moments and clipping."""

    optimizer: Literal["adamw", "muon"] = "muon"
    """"adamw" (every parameter) or "muon": torch.optim.Muon (Jordan et al. 2024; momentum,
    then the update orthogonalised by Newton-Schulz iterations) for the weight matrices of
    the Linear layers inside the blocks (attention and MLP), and AdamW for the rest
    (embeddings, unembedding, norm gains, biases). Muon's decoupled weight decay is
    weight_decay too. Not with fsdp or LoRA."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (the schedule scales it like lr)."""
    muon_momentum: float = 0.95
    """Muon's momentum coefficient (Nesterov)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to weight matrices and embeddings only (not to
    biases or LayerNorm gains)."""
    beta1: float = 0.9
    """AdamW's first moment coefficient (of the gradient's running mean)."""
    beta2: float = 0.99
    """AdamW's second moment coefficient (of the squared gradient's running mean)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; None disables clipping."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_real(self, "lr", 0.0, low_open=True)
        _check_real(self, "muon_lr", 0.0, low_open=True)
        _check_real(self, "muon_momentum", 0.0, 1.0, high_open=True)
        _check_real(self, "weight_decay", 0.0)
        _check_real(self, "beta1", 0.0, 1.0, high_open=True)
        _check_real(self, "beta2", 0.0, 1.0, high_open=True)
        if self.grad_clip is not None:
            _check_real(self, "grad_clip", 0.0, low_open=True)


@dataclass
class StepsConfig:
    """How many optimizer steps, and the learning rate's course over them."""

    max_steps: int = 500
    """Optimizer steps."""
    schedule: Literal["cosine", "constant", "wsd"] = "wsd"
    """"cosine" (linear warm-up, then cosine decay to min_lr), "constant" (lr at every step,
    no warm-up) or "wsd" (warm-up-stable-decay, a trapezoid: linear warm-up, lr until the
    last cooldown_fraction of decay_steps, then linear decay to min_lr; Hu et al. 2024,
    "MiniCPM", section 4)."""
    warmup_steps: int = 100
    """Steps of linear warm-up from lr / warmup_steps to lr."""
    decay_steps: int | None = None
    """The decay reaches min_lr at this step and stays there; None means max_steps (nanoGPT's
    lr_decay_iters). Set it to stop a run early (max_steps) and resume it later on the same
    schedule."""
    cooldown_fraction: float = 0.4
    """The share of decay_steps (default max_steps) that "wsd" spends decaying, in (0, 1]."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine or warm-up-stable-decay schedule, in [0, lr]."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_int(self, "max_steps")
        _check_int(self, "warmup_steps", low=0)
        if self.decay_steps is not None:
            _check_int(self, "decay_steps")
        _check_real(self, "cooldown_fraction", 0.0, 1.0, low_open=True)


@dataclass
class EvalConfig:
    """The validation estimates made while training."""

    eval_interval: int = 250
    """Estimate the validation loss every this many steps (and at the end)."""
    eval_batches: int = 20
    """Each validation estimate during training covers at most eval_batches optimizer-step
    batches (batch_size * grad_accum_steps * world_size windows each) of non-overlapping
    windows, spread evenly over the validation split; the same windows however a step is
    split into micro-batches."""

    def __post_init__(self) -> None:
        _check_int(self, "eval_interval", "eval_batches")


@dataclass
class LoggingConfig:
    """The metrics records: how often, where to, and the peak behind the mfu metric."""

    log_interval: int = 10
    """Write a metrics line every this many steps."""
    log: list[Literal["csv", "tensorboard"]] = dataclasses.field(default_factory=list)
    """More places for the metrics.jsonl records: "csv" (metrics.csv) and/or "tensorboard"
    (event files in tensorboard/, tags train/loss, val/loss, train/lr, train/grad_norm,
    train/mfu, train/tokens_per_s, val/bpb; needs the optional tensorboard package); repeat
    the flag for both."""
    peak_tflops: float | None = None
    """The device's peak TFLOP/s for the mfu metric (default: a table of known GPUs, or a
    matmul peak measured once on the CPU)."""

    def __post_init__(self) -> None:
        _check_int(self, "log_interval")
        if not isinstance(self.log, list) or not set(self.log) <= {"csv", "tensorboard"}:
            raise UserError(f"log must be a list of 'csv' and 'tensorboard', got {self.log!r}")
        if self.peak_tflops is not None:
            _check_real(self, "peak_tflops", 0.0, low_open=True)


@dataclass
class CheckpointConfig:
    """The resumable checkpoints written into the run directory's checkpoints/."""

    checkpoint_interval: int = 500
    """Write a resumable checkpoint every this many steps (0: only at the end and when
    interrupted)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""

    def __post_init__(self) -> None:
        _check_int(self, "checkpoint_interval", low=0)
        _check_int(self, "keep_checkpoints")


@dataclass
class ComputeConfig:
    """How the computation runs: number format, compilation, recomputation, sharding."""

    dtype: TrainDtypeName = "auto"
    """"float32"; "bfloat16" for bfloat16 autocast; "float16" for float16 autocast with a
    GradScaler (dynamic loss scaling); "auto" for bfloat16 where the device multiplies it
    natively (a GPU that supports it, a CPU with AVX-512 BF16 or AMX), float16 on older GPUs
    and float32 on other CPUs (stored as the one chosen, `training.loop.resolve_dtype`).
    Weights and optimizer state stay float32. "f32", "bf16", "f16" (and "fp32", "fp16") are
    the same (stored as the long names)."""
    compile: bool = False
    """Wrap the model in torch.compile for training."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of storing them (less
    memory, about 1/3 more compute)."""
    fsdp: bool = False
    """With torchrun, shard parameters, gradients and optimizer state with FSDP2
    (torch.distributed.fsdp.fully_shard) instead of replicating them with DDP."""

    def __post_init__(self) -> None:
        _check_bool(self, "compile", "activation_checkpointing", "fsdp")
        self.dtype = "auto" if self.dtype == "auto" else canonical_dtype(self.dtype)


@dataclass
class FinetuneConfig:
    """Which parameters train: frozen groups, and LoRA adapters."""

    freeze: str | None = None
    """Parameters that do not train, a comma-separated list of groups: embeddings (token
    embedding, position table; with tie_embeddings also the unembedding), head (the
    unembedding), norms (every norm's gain and bias), blocks (all decoder blocks), blocks:I
    or blocks:I-J (blocks I to J inclusive, 0-based), or a parameter-name pattern with *
    (e.g. blocks.*.attn.*); None trains everything. The optimizer holds only the parameters
    that train."""
    lora_rank: int | None = None
    """Add LoRA adapters of this rank r (Hu et al. 2021) to the lora_targets layers and train
    only them (None: no adapters)."""
    lora_alpha: float | None = None
    """LoRA's alpha: the update is (alpha / r) B A; None means alpha = r."""
    lora_targets: str = "qkv"
    """The linear layers that get adapters, comma-separated ends of module names: qkv, proj
    (attn.proj and mlp.proj), attn.proj, mlp.proj, fc, gate, lm_head (an untied unembedding);
    or Hugging Face Llama's names (peft's q_proj, ... too): q, k, v (row ranges of the fused
    qkv, each part its own adapter), o (attn.proj), gate, up (mlp.fc), down (mlp.proj)."""
    lora_dropout: float = 0.0
    """Dropout probability on the adapters' input (training mode only)."""

    def __post_init__(self) -> None:
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


@dataclass
class ArtifactsConfig:
    """The sample written after training, by `decoderlm.training.artifacts.write_artifacts`.

    Training itself never reads these settings.
    """

    sample_chars: int = 600
    """Characters (tokens) sampled into samples.txt after training."""
    sample_prompt: str = "T"
    """Prompt of that sample."""

    def __post_init__(self) -> None:
        _check_int(self, "sample_chars", low=0)
        if not isinstance(self.sample_prompt, str):
            raise UserError(f"sample_prompt must be text, got {self.sample_prompt!r}")


def _section(cls):
    """A TrainConfig field holding a new `cls` with its defaults."""
    return dataclasses.field(default_factory=cls)


@dataclass(init=False)
class TrainConfig:
    """How a model is trained, in sections; the defaults are what `decoderlm train` runs.

    Every setting lives in one section (``cfg.optim.lr``, ``cfg.steps.max_steps``, ...) and
    its name is unique across sections, so a flat dict of settings (a settings file's
    ``train:``, the command line's flags, config.json["train"]) says where each one goes:
    ``TrainConfig(lr=1e-3, max_steps=100)`` and `from_dict` (flat or nested dicts) put each
    setting in its section, and `to_dict` writes the flat dict.

    Attributes:
        data: batches, the validation split and the seed (`DataConfig`).
        optim: the optimizer (`OptimConfig`).
        steps: the number of steps and the learning-rate schedule (`StepsConfig`).
        evaluation: validation estimates while training (`EvalConfig`).
        logging: the metrics records (`LoggingConfig`).
        checkpointing: resumable checkpoints (`CheckpointConfig`).
        compute: number format, compilation, recomputation, sharding (`ComputeConfig`).
        finetune: frozen parameters and LoRA adapters (`FinetuneConfig`).
        artifacts: the sample written after training (`ArtifactsConfig`).

    Raises:
        UserError: a setting is out of range or not one of its choices (the message names
            it), min_lr is above lr with a decaying schedule, or Muon is asked for with fsdp
            or LoRA.
    """

    data: DataConfig = _section(DataConfig)
    optim: OptimConfig = _section(OptimConfig)
    steps: StepsConfig = _section(StepsConfig)
    evaluation: EvalConfig = _section(EvalConfig)
    logging: LoggingConfig = _section(LoggingConfig)
    checkpointing: CheckpointConfig = _section(CheckpointConfig)
    compute: ComputeConfig = _section(ComputeConfig)
    finetune: FinetuneConfig = _section(FinetuneConfig)
    artifacts: ArtifactsConfig = _section(ArtifactsConfig)

    def __init__(self, **settings: Any) -> None:
        """TrainConfig(lr=1e-3, max_steps=100): settings by name, each put in its section;
        a whole section may be given too (TrainConfig(optim=OptimConfig(lr=1e-3))), and the
        settings named beside it replace its values. The rest keep their defaults.

        Raises:
            UserError: a name that is no setting or section (the message lists the known
                ones), a section that is not its dataclass, or an invalid setting.
        """
        sections, owner = self.sections(), self.section_of()
        given: dict[str, dict[str, Any]] = {name: {} for name in sections}
        unknown = sorted(k for k in settings if k not in sections and k not in owner)
        if unknown:
            raise UserError(
                f"unknown TrainConfig field(s) {unknown}; known fields are {sorted(owner)}"
            )
        for key, value in settings.items():
            if key in owner:
                given[owner[key]][key] = value
        for name, cls in sections.items():
            section = settings.get(name)
            if section is None:
                section = cls(**given[name])
            elif isinstance(section, cls) and given[name]:
                section = dataclasses.replace(section, **given[name])
            setattr(self, name, section)
        self.__post_init__()

    def __post_init__(self) -> None:
        for name, cls in self.sections().items():
            if not isinstance(getattr(self, name), cls):
                raise UserError(
                    f"TrainConfig.{name} must be a {cls.__name__}, got {getattr(self, name)!r}"
                )
        if self.steps.schedule in ("cosine", "wsd"):
            _check_real(self.steps, "min_lr", 0.0, self.optim.lr)
        if self.optim.optimizer == "muon" and self.compute.fsdp:
            raise UserError(
                "optimizer 'muon' orthogonalises whole weight matrices, which fsdp shards; "
                "use --fsdp false (DDP) or --optimizer adamw"
            )
        if self.optim.optimizer == "muon" and self.finetune.lora_rank is not None:
            raise UserError(
                "optimizer 'muon' trains the blocks' weight matrices, which LoRA freezes; "
                "use --optimizer adamw with --lora-rank"
            )

    @classmethod
    def sections(cls) -> dict[str, type]:
        """{section name: its dataclass}, in order: {"data": DataConfig, ...}."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    @classmethod
    def section_of(cls) -> dict[str, str]:
        """{setting name: the section holding it}: {"lr": "optim", "max_steps": "steps", ...}."""
        return {
            f.name: section
            for section, section_cls in cls.sections().items()
            for f in dataclasses.fields(section_cls)
        }

    def to_dict(self) -> dict[str, Any]:
        """Every setting in one flat dict, {"batch_size": 32, ..., "sample_prompt": "T"}
        (config.json["train"]'s format)."""
        flat: dict[str, Any] = {}
        for name in self.sections():
            flat.update(dataclasses.asdict(getattr(self, name)))
        return flat

    @classmethod
    def flatten(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Settings as one flat dict: `data` flat ({"lr": 1e-3, "max_steps": 100}), nested
        by section ({"optim": {"lr": 1e-3}}) or both; returns {"lr": 1e-3, ...}.

        Raises:
            UserError: `data` is not a dict, or a key names no setting (the message lists the
                known ones).
        """
        if not isinstance(data, dict):
            raise UserError(f"TrainConfig must be built from a dict, got {type(data).__name__}")
        sections, owner = cls.sections(), cls.section_of()
        flat: dict[str, Any] = {}
        unknown = []
        for key, value in data.items():
            if key in sections and isinstance(value, dict):
                unknown += [f"{key}.{k}" for k in value if owner.get(k) != key]
                flat.update({k: v for k, v in value.items() if owner.get(k) == key})
            elif key in owner:
                flat[key] = value
            else:
                unknown.append(key)
        if unknown:
            raise UserError(
                f"unknown TrainConfig field(s) {sorted(unknown)}; known fields are {sorted(owner)}"
            )
        return flat

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """A TrainConfig from settings (flat, nested or both: see `flatten`), the rest at
        their defaults.

        Raises:
            UserError: `data` is not a dict, a key names no setting (the message lists the
                known ones), or a setting is invalid.
        """
        return cls(**cls.flatten(data))

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> TrainConfig:
        """The TrainConfig a run directory's config.json["train"] (or a checkpoint's) holds.
        Such a dict is flat (`to_dict`'s format) and lists every setting its run trained
        with; one without "optimizer" trained with AdamW alone.

        Raises:
            UserError: a key names no setting (the message lists the known ones), or a
                setting is invalid.
        """
        return cls(**{"optimizer": "adamw", **data})
