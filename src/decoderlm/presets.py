"""Named model shapes and training recipes: `decoderlm train --preset NAME`, `decoderlm presets`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import UserError

__all__ = ["Preset", "PRESETS", "PresetName", "get_preset"]


@dataclass(frozen=True)
class Preset:
    """A named model (ModelConfig fields) and the training settings (TrainConfig fields)
    that differ from TrainConfig's defaults.

    `decoderlm train --preset NAME` trains a character model of that shape: vocab_size is then
    set from the corpus's tokenizer. A preset without a model ("finetune") has training
    settings for `decoderlm train --init-from SRC`, whose model comes from SRC.
    """

    description: str
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)


# the seed experiment's model (vocab_size 139: the embedded corpus's 138 characters plus an
# unknown-character id)
SEED_MODEL = dict(vocab_size=139, block_size=96, n_layers=3, n_heads=4, d_model=128)

# Each preset's `train` lists only the TrainConfig settings it changes: the TrainConfig
# defaults are the 'default' recipe (what `decoderlm train` runs).
PRESETS: dict[str, Preset] = {
    "seed-notebook": Preset(
        description="the original seed experiment's run exactly: 3 layers x 128 wide, 4 heads, "
        "context 96, batch 32, 400 steps of AdamW at lr 2e-4, weight decay 1e-2, no schedule, "
        "no clipping, float32 (vocab_size 139: the embedded corpus's 138 characters plus an "
        "unknown-character id)",
        model=SEED_MODEL,
        train=dict(
            max_steps=400,
            optimizer="adamw",
            lr=2e-4,
            min_lr=2e-5,
            warmup_steps=0,
            schedule="constant",
            cooldown_fraction=0.2,
            weight_decay=1e-2,
            beta2=0.999,
            grad_clip=None,
            dtype="float32",
            eval_interval=100,
        ),
    ),
    "default": Preset(
        description="what `decoderlm train` runs: the seed model's shape (3 layers x 128 wide, "
        "4 heads, context 96, batch 32, dropout 0.05) with rotary positions, QK-norm, a "
        "ReLU^2 MLP, zero-initialised output projections and logits soft-capped at 15, "
        "trained 500 steps: Muon (lr 0.02) for the block matrices and AdamW (lr 3e-3, weight "
        "decay 0.1, beta2 0.99) for the rest, 100 warm-up steps then constant until the last "
        "40% decay to a tenth (WSD), clipping at 1.0, bfloat16 autocast where the device "
        "multiplies it natively, else float32 (dtype auto; the TrainConfig defaults)",
        model=dict(
            **SEED_MODEL,
            dropout=0.05,
            pos_encoding="rope",
            qk_norm=True,
            mlp="relu2",
            zero_init_proj=True,
            logit_softcap=15.0,
        ),
    ),
    "classic": Preset(
        description="GPT-2's architecture at the seed model's size (learned positions, a GELU "
        "MLP, dropout 0.05), trained 1,800 steps of AdamW with warm-up + cosine decay from "
        "lr 3e-3 to 3e-4, weight decay 0.1, beta2 0.99, clipping at 1.0, dtype auto; "
        "its runs export to the GPT-2 format",
        model=dict(**SEED_MODEL, dropout=0.05),
        train=dict(
            max_steps=1800,
            optimizer="adamw",
            schedule="cosine",
            cooldown_fraction=0.2,
            eval_interval=300,
        ),
    ),
    **{
        name: Preset(
            description=f"GPT-2 {size} (Radford et al. 2019; OpenAI's released hparams.json: "
            f"n_layer {layers}, n_embd {width}, n_head {heads}, n_ctx 1024, n_vocab 50257), "
            f"pre-norm, learned positions, tanh GELU, tied unembedding",
            model=dict(
                vocab_size=50257,
                block_size=1024,
                n_layers=layers,
                n_heads=heads,
                d_model=width,
                activation="gelu_tanh",
            ),
        )
        for name, size, layers, width, heads in [
            ("gpt2", "small (the paper's 117M)", 12, 768, 12),
            ("gpt2-medium", "medium (the paper's 345M)", 24, 1024, 16),
            ("gpt2-large", "large (the paper's 762M)", 36, 1280, 20),
            ("gpt2-xl", "XL (the paper's 1542M)", 48, 1600, 25),
        ]
    },
    "vaswani-base": Preset(
        description="the original transformer's base model (Vaswani et al. 2017, table 3: N 6, "
        "d_model 512, d_ff 2048, h 8, dropout 0.1, shared 37,000-token vocabulary, tied "
        "embeddings) as a decoder-only stack: post-norm, sinusoidal positions, context 512",
        model=dict(
            vocab_size=37000,
            block_size=512,
            n_layers=6,
            n_heads=8,
            d_model=512,
            d_ff=2048,
            dropout=0.1,
            pos_encoding="sinusoidal",
            norm_position="post",
        ),
    ),
    "llama-tiny": Preset(
        description="a small Llama-style model: rotary positions, RMSNorm, SwiGLU MLP (d_ff "
        "by Llama's rule), no biases, untied unembedding, 32,000-token vocabulary",
        model=dict(
            vocab_size=32000,
            block_size=512,
            n_layers=4,
            n_heads=4,
            d_model=256,
            pos_encoding="rope",
            norm="rmsnorm",
            mlp="swiglu",
            bias=False,
            tie_embeddings=False,
        ),
    ),
    **{
        name: Preset(
            description=f"{source}'s shape ({hf_class}: {model['n_layers']} layers x "
            f"{model['d_model']} wide, {model['n_heads']} query heads sharing "
            f"{model['n_kv_heads']} key/value heads of 64, SwiGLU {model['d_ff']:,}, "
            f"RMSNorm eps {model['norm_eps']:g}, rotary base {int(model['rope_base']):,}{extra}, "
            f"no biases{' but q/k/v' if model.get('qkv_bias') else ''}, tied unembedding, "
            f"{model['vocab_size']:,}-token vocabulary, context {model['block_size']:,}, as "
            f"its config.json); `decoderlm train` takes the corpus's vocabulary",
            model=dict(
                pos_encoding="rope",
                norm="rmsnorm",
                mlp="swiglu",
                bias=False,
                tie_embeddings=True,
                **model,
            ),
        )
        for name, source, hf_class, extra, model in [
            (
                "smollm2-135m",
                "SmolLM2-135M",
                "LlamaForCausalLM",
                "",
                dict(
                    vocab_size=49152,
                    block_size=8192,
                    n_layers=30,
                    n_heads=9,
                    n_kv_heads=3,
                    d_model=576,
                    d_ff=1536,
                    rope_base=100000.0,
                    norm_eps=1e-5,
                ),
            ),
            (
                "qwen2.5-0.5b",
                "Qwen2.5-0.5B",
                "Qwen2ForCausalLM",
                "",
                dict(
                    vocab_size=151936,
                    block_size=32768,
                    n_layers=24,
                    n_heads=14,
                    n_kv_heads=2,
                    d_model=896,
                    d_ff=4864,
                    qkv_bias=True,
                    rope_base=1000000.0,
                    norm_eps=1e-6,
                ),
            ),
            (
                "llama-3.2-1b",
                "Llama-3.2-1B",
                "LlamaForCausalLM",
                " with Llama 3's scaling (factor 32, low 1, high 4, original 8,192)",
                dict(
                    vocab_size=128256,
                    block_size=131072,
                    n_layers=16,
                    n_heads=32,
                    n_kv_heads=8,
                    d_model=2048,
                    d_ff=8192,
                    rope_base=500000.0,
                    rope_scaling={
                        "rope_type": "llama3",
                        "factor": 32.0,
                        "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192,
                    },
                    norm_eps=1e-5,
                ),
            ),
        ]
    },
}


# the 'default' recipe, gentler: for `decoderlm train --init-from SRC`, whose model comes from SRC
PRESETS["finetune"] = Preset(
    description="what `decoderlm train --init-from SRC` runs: the model of SRC (its shape "
    "and tokenizer), trained 300 steps of AdamW with a 20-step warm-up then cosine decay "
    "from lr 3e-4 to 3e-5 (a tenth of 'default'), no weight decay (it would pull the weights "
    "towards 0, not towards the pretrained ones), clipping at 1.0, dtype auto",
    train=dict(
        optimizer="adamw",  # Muon is not for LoRA adapters, and moves pretrained weights far
        schedule="cosine",
        max_steps=300,
        lr=3e-4,
        min_lr=3e-5,
        warmup_steps=20,
        weight_decay=0.0,
        eval_interval=50,
    ),
)


# the preset names, as a type: a flag of this type takes one of them
PresetName = Literal[tuple(sorted(PRESETS))]


def get_preset(name: str) -> Preset:
    """Return the preset called `name`; raises UserError listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}") from None
