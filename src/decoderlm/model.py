"""The whole model: positions, norms, causal self-attention, MLP, decoder block, `DecoderLM`.

A decoder-only transformer, GPT-2 style by default (Radford et al. 2019), read top to bottom:

    x = tok_emb(idx) [+ positions (learned or sinusoidal)]    # [B, T, d_model]
    for each block (pre-norm):  x = x + attn(norm_1(x))       # rope rotates q, k inside attn
                                x = x + mlp(norm_2(x))
              (post-norm):      x = norm_1(x + attn(x)); x = norm_2(x + mlp(x))
    logits = lm_head(norm_f(x))  (pre-norm; post-norm has no final norm)   # [B, T, vocab_size]

Attention is scaled dot-product attention (Vaswani et al. 2017, eq. 1):
softmax(q k^T / sqrt(head_dim) + causal mask) v, with future positions set to -inf before
the softmax so they get exactly zero weight. The options are described in `ModelConfig`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig

__all__ = ["DecoderLM", "CausalSelfAttention", "MLP", "Block", "RMSNorm", "Linear",
           "rowwise_linear", "reduction_linear", "causal_attention", "sinusoidal_positions",
           "rope_cos_sin", "apply_rope", "rope_interleaved_to_half"]


def sinusoidal_positions(T: int, d_model: int) -> torch.Tensor:
    """The fixed position table of Vaswani et al. 2017, section 3.5, [T, d_model] float32:
    PE(pos, 2i) = sin(pos / 10000^(2i / d_model)), PE(pos, 2i + 1) = cos(pos / 10000^(2i /
    d_model))."""
    pos = torch.arange(T, dtype=torch.float64)[:, None]
    angle = pos / 10000.0 ** (torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    pe = torch.zeros(T, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return pe.float()


def rope_cos_sin(T: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """cos and sin of the rotary angles m * theta_i, theta_i = base^(-2i / head_dim)
    (Su et al. 2021, eq. 15), for positions m = 0..T-1: two [T, head_dim / 2] float32."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angle).float(), torch.sin(angle).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, n_heads, T, head_dim] by position (cos, sin: [T, head_dim / 2]).

    Half-split layout (GPT-NeoX, Hugging Face Llama): feature j of the first half and feature
    j of the second half form the pair rotated by angle m * theta_j. Weights trained with the
    interleaved layout (pairs 2j, 2j + 1; Meta's Llama) need their q/k projection rows
    permuted to use it.
    """
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rope_interleaved_to_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute the rows of a q or k projection weight [n_heads * head_dim, d_in] trained with
    the interleaved rotary layout (pairs 2j, 2j + 1; Meta's Llama, RoFormer) into the
    half-split layout `apply_rope` uses (pairs j, j + head_dim / 2). Scores q.k, and so the
    logits, are unchanged."""
    head_dim = weight.size(0) // n_heads
    rows = torch.arange(weight.size(0)).view(n_heads, head_dim // 2, 2).transpose(1, 2)
    return weight[rows.reshape(-1)]


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as a two-way batched matmul over halves of the rows
    of weight ([out, in]); x [..., in] with few rows.

    Why: with one row, F.linear is a matrix-vector product that MKL reads at 13-23 GB/s on
    this project's AMD CPU, while the batched form reads at 52-58 GB/s (GPT-2's 50,257 x 768
    unembedding: 9.2 -> 2.7 ms per token; benchmarks/gemv.py, weights read from memory).
    """
    rows, d = x.numel() // x.size(-1), x.size(-1)
    flat = x.reshape(rows, d)
    even = weight.size(0) - weight.size(0) % 2
    halves = weight[:even].view(2, even // 2, d)
    y = torch.bmm(halves, flat.T.expand(2, d, rows)).reshape(even, rows).T
    if even < weight.size(0):
        y = torch.cat([y, flat @ weight[even:].T], dim=1)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.size(0))


def reduction_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) written as a multiply-and-sum over `in`, accumulated in float32
    and returned in x's dtype; x [..., in], weight [out, in] -> [..., out].

    Meant for torch.compile, which fuses it into one pass over weight per output row (one
    kernel, no [out, in] temporary): with one row in bfloat16 on this project's CPU it reads
    the weight 2-3x faster than oneDNN's product (benchmarks/gemv.py). Eagerly it is correct
    but builds the [..., out, in] product, so `Linear` uses it only while compiling.
    """
    y = (x.float().unsqueeze(-2) * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear with faster products for decoding (few rows, no autograd) on the CPU:
    float32 with a weight of 2^19 elements or more runs as `rowwise_linear`; any other one-row
    product under torch.compile (`generate(..., compile=True)`) runs as `reduction_linear`.
    Everything else, training included, is exactly nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and not torch.is_grad_enabled():
            if (x.dtype == torch.float32 and self.weight.numel() >= 2**19
                    and x.numel() <= 4 * x.size(-1)):
                return rowwise_linear(x, self.weight, self.bias)
            if x.numel() == x.size(-1) and torch.compiler.is_compiling():
                return reduction_linear(x, self.weight, self.bias)
        return super().forward(x)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (Zhang & Sennrich 2019,
    eq. 4). x [..., d] -> [..., d]."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def make_norm(config: ModelConfig) -> nn.Module:
    """The norm the config asks for, over d_model."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal scaled dot-product attention, written out, returning the probabilities too.

    Args:
        q, k, v: [B, n_heads, T, head_dim], any floating dtype.
        dropout_p: dropout on the attention probabilities (pass 0.0 in eval mode).

    Returns:
        (y, att): y [B, n_heads, T, head_dim] in q's dtype; att [B, n_heads, T, T] float32,
        the softmax probabilities before dropout. Row t sums to 1 and att[..., t, s] == 0 for
        every s > t.

    q is scaled by 1/sqrt(head_dim) *before* the matmul and the scores and softmax are
    computed in float32, so float16 inputs with large q.k do not overflow.
    """
    T = q.size(-2)
    scores = (q * (1.0 / math.sqrt(q.size(-1)))) @ k.transpose(-2, -1)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    att = scores.float().masked_fill(future, float("-inf")).softmax(dim=-1)
    y = F.dropout(att, dropout_p) if dropout_p > 0 else att
    return (y.to(v.dtype) @ v), att


def _explicit_is_faster(q: torch.Tensor, cache, mask) -> bool:
    """Training in bfloat16 on the CPU with a short context: PyTorch's CPU flash-attention
    kernel is much slower in bfloat16 than in float32 (forward + backward at B 12, T 64, 4
    heads of 32: 3.0 vs 0.71 ms, and 0.72 ms written out; benchmarks/attention_backward.py),
    so the written-out attention wins there, and its T x T probabilities are small for
    T <= 128. Everywhere else the fused kernel keeps memory linear in T."""
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and torch.is_grad_enabled()
            and cache is None and mask is None and 1 < q.size(-2) <= 128)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection.

    forward(x [B, T, d_model], rope=None, need_weights=False, cache=None, mask=None) ->
    (y [B, T, d_model], att | None); rope is (cos, sin) [T or B x 1 x T, head_dim / 2] when the
    config's pos_encoding is "rope". For cached decoding, cache = (k_buf, v_buf, start): the
    new keys and values are written at positions start.. of the [B, n_heads, T_max, head_dim]
    buffers and attention runs over all start + T of them under `mask` (bool [B, 1, T, S]);
    mask None there means no padding and either one new token (it sees every key) or an
    empty cache (plain causal). The default path calls `F.scaled_dot_product_attention`
    (fused kernels; causal unless there is one query); with need_weights=True it runs
    `causal_attention` and also returns att [B, n_heads, T, T].
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.qkv = Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: tuple | None = None, need_weights: bool = False,
                cache: tuple | None = None, mask: torch.Tensor | None = None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        dropout_p = self.dropout if self.training else 0.0
        if cache is not None:  # (k_buf, v_buf [B, n_heads, T_max, head_dim], start)
            k_buf, v_buf, start = cache
            k_buf[:, :, start:start + T] = k
            v_buf[:, :, start:start + T] = v
            k, v = k_buf[:, :, :start + T], v_buf[:, :, :start + T]
        if need_weights:
            y, att = causal_attention(q, k, v, dropout_p)
        elif _explicit_is_faster(q, cache, mask):
            y, att = causal_attention(q, k, v, dropout_p)[0], None
        else:  # mask: bool [B, 1, T, S], True where query t may attend to key s
            y, att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                    is_causal=mask is None and T > 1), None
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.proj(y)), att


class MLP(nn.Module):
    """Position-wise feed-forward, x [B, T, d_model] -> [B, T, d_model].

    "gelu": proj(GELU(fc(x))), GELU exact (erf) or tanh-approximate per config.activation.
    "swiglu": proj(silu(gate(x)) * fc(x)) (Shazeer 2020, eq. 6 with Swish_1 = SiLU).
    Dropout on the output.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = Linear(config.d_model, config.d_ff, bias=config.bias)
        self.gate = (Linear(config.d_model, config.d_ff, bias=config.bias)
                     if config.mlp == "swiglu" else None)
        self.proj = Linear(config.d_ff, config.d_model, bias=config.bias)
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            h = F.silu(self.gate(x)) * self.fc(x)
        else:
            h = F.gelu(self.fc(x), approximate=self.approximate)
        return self.dropout(self.proj(h))


class Block(nn.Module):
    """One decoder block. Pre-norm (GPT-2): x + attn(ln_1(x)), then x + mlp(ln_2(x)).
    Post-norm (Vaswani et al. 2017): ln_1(x + attn(x)), then ln_2(x + mlp(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: tuple | None = None, need_weights: bool = False,
                cache: tuple | None = None, mask: torch.Tensor | None = None):
        if self.pre_norm:
            a, att = self.attn(self.ln_1(x), rope, need_weights, cache, mask)
            x = x + a
            return x + self.mlp(self.ln_2(x)), att
        a, att = self.attn(x, rope, need_weights, cache, mask)
        x = self.ln_1(x + a)
        return self.ln_2(x + self.mlp(x)), att


class DecoderLM(nn.Module):
    """A decoder-only language model (GPT-2 style unless the config says otherwise).

    Args:
        config: the `ModelConfig`.

    Initialisation follows GPT-2: every Linear and Embedding weight ~ N(0, 0.02), biases 0,
    and the two residual output projections of each block (attn.proj, mlp.proj) ~
    N(0, 0.02 / sqrt(2 * n_layers)), since 2 * n_layers residual branches add into the stream.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = (nn.Embedding(config.block_size, config.d_model)
                        if config.pos_encoding == "learned" else None)
        # fixed tables are buffers, rebuilt from the config, not stored in checkpoints
        if config.pos_encoding == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_positions(config.max_positions,
                                                                   config.d_model),
                                 persistent=False)
        if config.pos_encoding == "rope":
            cos, sin = rope_cos_sin(config.max_positions, config.head_dim, config.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = make_norm(config) if config.norm_position == "pre" else None
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # TrainConfig.activation_checkpointing: recompute each block in the backward pass
        self.activation_checkpointing = False
        residual_std = 0.02 / math.sqrt(2 * config.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def _check_input(self, idx: torch.Tensor) -> None:
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be an int64 tensor of shape [B, T], got dtype "
                             f"{idx.dtype} and shape {tuple(idx.shape)}")
        T, limit = idx.size(1), self.config.max_positions
        if T > limit:
            raise ValueError(f"sequence length T={T} exceeds {self.config.length_limit}; pass "
                             f"at most {limit} tokens (generate() crops the context)")
        if T == 0:
            raise ValueError("idx has no tokens (T=0); pass at least one token id")
        if not torch.compiler.is_compiling():
            lo, hi = (int(v) for v in torch.aminmax(idx))
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"token ids must be in [0, vocab_size={self.config.vocab_size}), "
                                 f"got ids from {lo} to {hi}; was the input encoded with this "
                                 f"model's tokenizer?")

    def _run(self, idx: torch.Tensor, need_weights: bool, position_ids=None, caches=None,
             mask=None, last_only: bool = False):
        self._check_input(idx)
        pos = torch.arange(idx.size(1), device=idx.device) if position_ids is None \
            else position_ids
        x, rope = self.tok_emb(idx), None
        if self.pos_emb is not None:
            x = x + self.pos_emb(pos)
        elif self.config.pos_encoding == "sinusoidal":
            x = x + self.pos_table[pos]
        else:
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]
            rope = (cos[:, None], sin[:, None]) if pos.dim() == 2 else (cos, sin)
        x = self.drop(x)
        atts = []
        for i, block in enumerate(self.blocks):
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                # keep only the block's input; its activations are recomputed in backward
                x, att = checkpoint(block, x, rope, False, None, mask, use_reentrant=False)
            else:
                x, att = block(x, rope, need_weights, None if caches is None else caches[i],
                               mask)
            atts.append(att)
        if last_only:  # decoding needs only the next token's logits
            x = x[:, -1:]
        if self.ln_f is not None:
            x = self.ln_f(x)
        return self.lm_head(x), atts

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for every position, and the next-token loss when targets are given.

        Args:
            idx: [B, T] int64 token ids, T <= max_positions (block_size unless the config
                allows more).
            targets: [B, T] int64, the token that follows each position (idx shifted left by
                one); -1 marks a position to ignore. None skips the loss.

        Returns:
            (logits [B, T, vocab_size] float32 (or the autocast dtype), loss): loss is the mean
            cross-entropy over non-ignored positions, a float32 scalar in nats, or None.

        Raises:
            ValueError: idx is not [B, T] integer, T is 0 or exceeds max_positions, or an id is
                outside [0, vocab_size).
        """
        logits, _ = self._run(idx, need_weights=False)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                   targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def forward_with_attention(self, idx: torch.Tensor):
        """Logits and every layer's attention probabilities, through the explicit path.

        Args:
            idx: [B, T] int64 token ids.

        Returns:
            (logits [B, T, vocab_size], att [n_layers, B, n_heads, T, T] float32), where
            att[l, b, h, t] is the distribution over key positions 0..t of query t in layer l,
            head h. Slower than `forward`; meant for analysis and plots.
        """
        logits, atts = self._run(idx, need_weights=True)
        return logits, torch.stack(atts)

    def forward_cached(self, idx: torch.Tensor, cache, position_ids: torch.Tensor,
                       key_mask: torch.Tensor | None = None,
                       last_only: bool = False) -> torch.Tensor:
        """Logits of new tokens given the keys and values of the earlier ones (decoding).

        Args:
            idx: [B, T] int64, the new tokens.
            cache: a `decoderlm.generate.KVCache` holding cache.length earlier positions; the
                new keys and values are appended to it (its length grows by T).
            position_ids: [B, T] int64, each new token's position (< max_positions).
            key_mask: [B, cache.length + T] bool, False for padding (never attended to);
                None means no padding.
            last_only: compute the logits of the last position only.

        Returns:
            logits [B, T, vocab_size] ([B, 1, vocab_size] with last_only).
        """
        T, start = idx.size(1), cache.length
        S = start + T
        mask = None  # without padding, one new token or an empty cache needs no mask
        if key_mask is not None or (T > 1 and start > 0):
            if key_mask is None:
                key_mask = torch.ones(idx.size(0), S, dtype=torch.bool, device=idx.device)
            causal = torch.ones(T, S, dtype=torch.bool, device=idx.device).tril(start)
            # a padding query may see no key at all; letting every query see itself keeps
            # every softmax row finite (no NaN); the outputs at padding are never used
            itself = torch.arange(S, device=idx.device) == \
                (torch.arange(T, device=idx.device) + start)[:, None]
            mask = ((causal[None] & key_mask[:, None, :]) | itself[None])[:, None]
        caches = [(k, v, start) for k, v in zip(cache.k, cache.v)]
        logits, _ = self._run(idx, False, position_ids, caches, mask, last_only)
        cache.length = S
        return logits

    @property
    def device(self) -> torch.device:
        """The device of the model's weights (that of the unembedding)."""
        return self.lm_head.weight.device

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Number of unique parameters (a tied matrix counts once).

        non_embedding=True leaves out the learned position table, if any (the nanoGPT
        convention: the token embedding stays in because it is also the unembedding when
        tied). Fixed sinusoidal and rotary tables are buffers, not parameters.
        """
        n = sum(p.numel() for p in self.parameters())
        return n - self.pos_emb.weight.numel() if non_embedding and self.pos_emb is not None else n

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx [B, T]; see `decoderlm.generate`."""
        from .generate import generate
        return generate(self, idx, max_new_tokens, **kwargs)

    def save_pretrained(self, directory: str | Path, extra_config: dict | None = None) -> None:
        """Write model.safetensors and config.json into `directory` (created if missing).

        extra_config: more top-level entries for config.json (the trainer stores its
        TrainConfig under "train").
        """
        from .weights import save_model
        save_model(self, directory, extra_config)

    @classmethod
    def from_pretrained(cls, directory: str | Path, map_location: str = "cpu") -> "DecoderLM":
        """Load a model written by `save_pretrained` (or `decoderlm train`), in eval mode.

        Raises:
            FileNotFoundError: config.json or model.safetensors is missing.
            ValueError: the files do not describe a matching model.
        """
        from .weights import load_model
        return load_model(directory, map_location)
