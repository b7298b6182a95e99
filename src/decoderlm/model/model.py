"""The model: positions, norms, causal self-attention, MLP, decoder block, `DecoderLM`.

A decoder-only transformer, GPT-2 style by default (Radford et al. 2019), read top to bottom:

    x = tok_emb(idx) [+ positions (learned or sinusoidal)]    # [B, T, d_model]
    for each block (pre-norm):  x = x + attn(ln_1(x))         # rope rotates q, k inside attn
                                x = x + mlp(ln_2(x))
              (post-norm):      x = ln_1(x + attn(x)); x = ln_2(x + mlp(x))
    logits = lm_head(ln_f(x))  (pre-norm; post-norm has no final norm)   # [B, T, vocab_size]
    (a padded vocabulary's extra rows are dropped from the logits: they are never produced)

Attention is scaled dot-product attention (Vaswani et al. 2017, eq. 1):
softmax(q k^T / sqrt(head_dim) + causal mask) v, with future positions set to -inf before
the softmax so they get exactly zero weight. The options are described in `ModelConfig`.
Activations are reachable by name through `HookPoint`s (listed in `DecoderLM`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..config import ModelConfig
from ..cpu import native_bfloat16
from ..errors import UserError
from ..tokenizers.load import read_end_of_text_id
from .dropout import Dropout, dropout
from .hooks import HeadsHookPoint, HookPoint
from .kv_cache import KVCache
from .positions import apply_rope, rope_cos_sin, sinusoidal_positions
from .weights import load_state, read_model_dir, resolve_tied, save_model

__all__ = [
    "DecoderLM",
    "CausalSelfAttention",
    "MLP",
    "Block",
    "RMSNorm",
    "NormHooks",
    "Unembed",
    "attention_scores",
    "attention_pattern",
    "one_query_attention",
    "eval_mode",
]


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (Zhang & Sennrich 2019,
    eq. 4). x [..., d] -> [..., d]."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def make_norm(config: ModelConfig) -> nn.Module:
    """The norm the config asks for, over d_model."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


class NormHooks(nn.Module):
    """TransformerLens's two hook points of a norm (blocks.l.ln1 and ln2, ln_final); it holds
    no weights, the norm it hooks does (blocks.l.ln_1, ln_2, ln_f).

    hook_scale       [B, T, 1]        the divisor sqrt(mean((x - mean x)^2) + eps) (RMSNorm:
                                      sqrt(mean(x^2) + eps)), float32
    hook_normalized  [B, T, d_model]  (x - mean x) / scale (RMSNorm: x / scale), before the
                                      gain and bias, float32

    as TransformerLens's TransformerBridge (and its HookedTransformer's RMSNorm and folded
    LayerNormPre) compute them. Called as ln1(ln_1, x) -> ln_1(x) [B, T, d_model]. With a
    hook attached to either point the norm is written out in float32 (the hooks see, and may
    replace, both), then gain and bias, cast back to x's dtype: the output equals norm(x) up
    to float rounding. With none attached, norm(x) runs as it is.
    """

    def __init__(self):
        super().__init__()
        self.hook_scale, self.hook_normalized = HookPoint(), HookPoint()

    def __call__(self, norm: nn.Module, x: Tensor) -> Tensor:
        # no nn.Module dispatch: the unhooked path costs one Python call more than norm(x)
        if not (self.hook_scale.has_hooks() or self.hook_normalized.has_hooks()):
            return norm(x)
        h = x.float()
        if isinstance(norm, nn.LayerNorm):
            h = h - h.mean(-1, keepdim=True)
        scale = self.hook_scale((h.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt())
        h = self.hook_normalized(h / scale) * norm.weight.float()
        if getattr(norm, "bias", None) is not None:
            h = h + norm.bias.float()
        return h.to(x.dtype)


class Unembed(nn.Module):
    """TransformerLens's hook points of the unembedding (``unembed``); it holds no weights:
    the matrix is DecoderLM.lm_head and the logits are `DecoderLM.to_logits`.

    hook_in   [B, T, d_model]     what lm_head reads (after ln_f, gain and bias included)
    hook_out  [B, T, vocab_size]  the logits (padded rows dropped, softcap applied)
    """

    def __init__(self):
        super().__init__()
        self.hook_in, self.hook_out = HookPoint(), HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        """Refused with a UserError: this module only names the hook points. The logits of x
        are DecoderLM.to_logits(x) (of a residual state before the final norm:
        `decoderlm.lens.lens.unembed(model, x)`)."""
        raise UserError(
            "model.unembed holds the unembedding's hook points (hook_in, hook_out); compute "
            "logits with model.to_logits(x), or decoderlm.lens.lens.unembed(model, resid) to "
            "apply the final norm first"
        )


def _scores(q: Tensor, k: Tensor) -> Tensor:
    """q k^T / sqrt(head_dim) per query head: q [B, n_heads, T, head_dim], k [B, n_kv_heads,
    S, head_dim] -> [B, n_heads, T, S]. With grouped heads (n_kv_heads < n_heads) the G =
    n_heads / n_kv_heads query heads of a group (consecutive heads) are stacked along T, so
    each key head multiplies once, without repeating k."""
    B, H, T, D = q.shape
    q = q * (1.0 / math.sqrt(D))
    if k.size(1) == H:
        return q @ k.transpose(-2, -1)
    return (q.reshape(B, k.size(1), -1, D) @ k.transpose(-2, -1)).view(B, H, T, -1)


def _weighted(att: Tensor, v: Tensor) -> Tensor:
    """att v per query head: att [B, n_heads, T, S] (in v's dtype), v [B, n_kv_heads, S,
    head_dim] -> [B, n_heads, T, head_dim]; grouped heads as in `_scores`, v not repeated."""
    B, H, T, S = att.shape
    if v.size(1) == H:
        return att @ v
    return (att.reshape(B, v.size(1), -1, S) @ v).view(B, H, T, -1)


def attention_scores(q: Tensor, k: Tensor) -> Tensor:
    """Causal attention scores before the softmax: q k^T / sqrt(head_dim), future positions
    -inf (TransformerLens's hook_attn_scores, which masks with -inf too).

    q [B, n_heads, T, head_dim], k [B, n_kv_heads, T, head_dim] (n_kv_heads divides n_heads;
    query head h reads key head h // (n_heads / n_kv_heads)), any floating dtype. Returns
    [B, n_heads, T, T] float32, scores[..., t, s] = -inf for every s > t. q is scaled before
    the matmul, so float16 inputs with large q.k do not overflow.
    """
    T = q.size(-2)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return _scores(q, k).float().masked_fill(future, float("-inf"))


def attention_pattern(q: Tensor, k: Tensor) -> Tensor:
    """Causal attention probabilities softmax(q k^T / sqrt(head_dim)), future masked:
    `attention_scores` (same q, k) after a float32 softmax. Returns att [B, n_heads, T, T]
    float32: row t sums to 1 and att[..., t, s] == 0 for every s > t."""
    return attention_scores(q, k).softmax(dim=-1)


ONE_QUERY_MIN_ELEMENTS = 2**15  # n_kv_heads x keys x head_dim; below it the fused kernel wins


def _written_out_wins(q: Tensor, k: Tensor) -> bool:
    """Whether `one_query_attention` beats scaled_dot_product_attention: bfloat16 on a CPU
    with native bfloat16 kernels (`decoderlm.cpu.native_bfloat16`) once a sequence's keys
    hold 2^15 elements or more (n_kv_heads x S x head_dim: 43 keys of GPT-2 small's 12 x 64,
    256 of 4 x 32), past which torch's CPU flash-attention kernel
    (aten::_scaled_dot_product_flash_attention_for_cpu in `python benchmarks/decode_profile.py
    --shape small`) takes up to several times longer for one query; its cost grows about
    twice as fast with S as the written-out product's. Under torch.compile it is chosen in
    every dtype and at every length: inductor fuses it (`_reduced_one_query`), and a choice
    that depends on the cache's length would guard on it and compile the decoding step a
    second time once the cache passes the threshold."""
    if q.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():
        return True
    return (
        q.dtype == torch.bfloat16 and native_bfloat16() and k[0].numel() >= ONE_QUERY_MIN_ELEMENTS
    )


def _float32_wins(q: Tensor) -> bool:
    """Whether one query's bfloat16 attention runs faster as scaled_dot_product_attention on
    float32 copies of q, k and v: eagerly on a CPU without native bfloat16 kernels (AVX2),
    where torch's flash-attention kernel in bfloat16 takes 1.4-4x as long as the copies and
    the float32 kernel together from 64 keys on (a few microseconds less below), and the
    written-out attention longer still (`python benchmarks/attention_one_query.py`; figures
    in benchmarks/README.md)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and not torch.compiler.is_compiling()
        and not native_bfloat16()
    )


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> Tensor:
    """F.scaled_dot_product_attention over grouped heads: q [B, n_heads, T, head_dim], k, v
    [B, n_kv_heads, S, head_dim] -> [B, n_heads, T, head_dim]; under mask (bool [B, 1, T, S],
    True where allowed), or causal where mask is None and T > 1."""
    grouped = {"enable_gqa": True} if k.size(1) != q.size(1) else {}
    if mask is None and q.size(2) > 1:  # a branch: traced with a symbolic T, a guard on it
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, **grouped
        )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, **grouped)


def one_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(head_dim)) v for new queries that may see every key allowed by
    `mask` (bool [B, 1, T, S], True where allowed; None: all of them, as for one new token
    after its cache): q [B, n_heads, T, head_dim], k, v [B, n_kv_heads, S, head_dim] (grouped
    as in `attention_pattern`) -> [B, n_heads, T, head_dim] in v's dtype; the softmax runs in
    float32. Under torch.compile both products are written as multiply-and-sum over
    float32 (`_reduced_one_query`), which inductor fuses into loops over the keys; eagerly
    they are matmuls."""
    if torch.compiler.is_compiling():
        return _reduced_one_query(q, k, v, mask)
    scores = _scores(q, k).float()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return _weighted(scores.softmax(dim=-1).to(v.dtype), v)


def _reduced_one_query(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """`one_query_attention` as multiply-and-sum (shapes as there): the G = n_heads /
    n_kv_heads query heads of a group stacked as in `_scores`, scores [B, n_kv_heads, G T,
    S] and the weighted sum [B, n_kv_heads, G T, head_dim] each one reduction."""
    B, H, T, D = q.shape
    H_kv = k.size(1)
    q = q.float().reshape(B, H_kv, -1, 1, D) * (1.0 / math.sqrt(D))
    scores = (q * k.float()[:, :, None]).sum(-1).view(B, H, T, -1)  # [B, n_heads, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    att = scores.softmax(dim=-1).view(B, H_kv, -1, scores.size(-1), 1)
    return (att * v.float()[:, :, None]).sum(-2).view(B, H, T, D).to(v.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention with one fused QKV projection.

    qkv: Linear(d_model, (n_heads + 2 n_kv_heads) head_dim), its output rows ordered q
    (n_heads head_dim), k (n_kv_heads head_dim), v (n_kv_heads head_dim), each head by head;
    proj: Linear(n_heads head_dim, d_model). Query head h reads key/value head
    h // (n_heads / n_kv_heads) (Hugging Face's repeat_kv order).

    forward(x [B, T, d_model], rope=None, cache=None, mask=None) -> [B, T, d_model].
    rope: (cos, sin) [T or B x 1 x T, head_dim / 2] when the config's pos_encoding is "rope".
    cache: a `KVCache` (decoding); this layer's new keys and values are appended to it and
    attention runs over all of them under `mask` (bool [B, 1, T, S], True where query t may
    see key s; None: plain causal, see `KVCache.attention_mask`); one new bfloat16 token over
    many cached keys on a CPU with native bfloat16 kernels, or any one new token under
    torch.compile, runs `one_query_attention` (the same product, faster there), and one new
    bfloat16 token on a CPU without them runs the fused kernel on float32 copies.

    `impl` picks the training kernel: "sdpa" (F.scaled_dot_product_attention, memory linear in
    T) or "explicit" (`attention_scores` and the softmax written out, in training mode; eval
    mode keeps sdpa). A hook attached to hook_attn_scores or hook_pattern takes the explicit
    path in either mode, so its hooks see (and may replace) the scores or the probabilities;
    with nothing attached the fused kernel runs. With a cache neither is computed.
    """

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.layer = config.n_heads, config.n_kv_heads, layer
        self.head_dim = config.head_dim
        self.dropout = config.dropout_at("attn")
        self.qk_norm_eps = config.norm_eps if config.qk_norm else None
        self.impl = "sdpa"
        rows = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.qkv = nn.Linear(config.d_model, rows, bias=config.bias or config.qkv_bias)
        # hooks see q as [B, T, n_heads, head_dim], k and v as [B, T, n_kv_heads, head_dim]
        # (TransformerLens's layout, grouped heads kept grouped)
        self.hook_q, self.hook_k = HeadsHookPoint(), HeadsHookPoint()
        self.hook_v = HeadsHookPoint()
        if config.pos_encoding == "rope":  # q and k after the rotation (TransformerLens's)
            self.hook_rot_q, self.hook_rot_k = HeadsHookPoint(), HeadsHookPoint()
        self.hook_attn_scores, self.hook_pattern = HookPoint(), HookPoint()
        self.hook_z = HookPoint()
        self.proj = nn.Linear(config.n_heads * config.head_dim, config.d_model, bias=config.bias)
        self.resid_dropout = Dropout(config.dropout_at("resid"))

    def forward(self, x: Tensor, rope=None, cache: KVCache | None = None, mask=None) -> Tensor:
        B, T, _ = x.shape
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = (
            t.view(B, T, -1, D).transpose(1, 2)
            for t in self.qkv(x).split((H * D, H_kv * D, H_kv * D), dim=2)
        )  # q [B, n_heads, T, head_dim]; k, v [B, n_kv_heads, T, head_dim]
        if self.qk_norm_eps is not None:  # QK-norm: unit RMS over head_dim, no gain
            q = F.rms_norm(q, (q.size(-1),), eps=self.qk_norm_eps)
            k = F.rms_norm(k, (k.size(-1),), eps=self.qk_norm_eps)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if rope is not None:
            q = self.hook_rot_q(apply_rope(q, *rope))
            k = self.hook_rot_k(apply_rope(k, *rope))
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # [B, n_kv_heads, S, head_dim], S = length + T
        dropout_p = self.dropout if self.training else 0.0
        explicit = self.impl == "explicit" and self.training
        hooked = self.hook_attn_scores.has_hooks() or self.hook_pattern.has_hooks()
        if cache is None and (explicit or hooked):
            scores = self.hook_attn_scores(attention_scores(q, k))  # [B, n_heads, T, T] f32
            att = self.hook_pattern(scores.softmax(dim=-1))
            att = dropout(att, dropout_p)
            z = _weighted(att.to(v.dtype), v)
        elif cache is not None and T == 1 and _written_out_wins(q, k):
            z = one_query_attention(q, k, v, mask)
        elif cache is not None and T == 1 and _float32_wins(q):
            z = _sdpa(q.float(), k.float(), v.float(), mask, dropout_p).to(v.dtype)
        else:
            z = _sdpa(q, k, v, mask, dropout_p)
        y = self.hook_z(z.transpose(1, 2)).reshape(B, T, H * D)  # z [B, T, n_heads, head_dim]
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward, x [B, T, d_model] -> [B, T, d_model].

    "gelu": proj(GELU(fc(x))), GELU exact (erf) or tanh-approximate per config.activation.
    "swiglu": proj(silu(gate(x)) * fc(x)) (Shazeer 2020, eq. 6 with Swish_1 = SiLU).
    "relu2": proj(relu(fc(x))^2) (So et al. 2021, squared ReLU).
    Dropout on the output. hook_pre sees the activation's input [B, T, d_ff] (fc(x), or
    gate(x) for swiglu), hook_post the hidden layer [B, T, d_ff] that proj reads.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.gate = (
            nn.Linear(config.d_model, config.d_ff, bias=config.bias)
            if config.mlp == "swiglu"
            else None
        )
        self.hook_pre, self.hook_post = HookPoint(), HookPoint()
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"
        self.relu2 = config.mlp == "relu2"
        self.dropout = Dropout(config.dropout_at("resid"))

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is not None:
            h = F.silu(self.hook_pre(self.gate(x))) * self.fc(x)
        elif self.relu2:
            h = F.relu(self.hook_pre(self.fc(x))).square()
        else:
            h = F.gelu(self.hook_pre(self.fc(x)), approximate=self.approximate)
        return self.dropout(self.proj(self.hook_post(h)))


class Block(nn.Module):
    """One decoder block, x [B, T, d_model] -> [B, T, d_model].

    Pre-norm (GPT-2): x + attn(ln_1(x)), then x + mlp(ln_2(x)).
    Post-norm (Vaswani et al. 2017): ln_1(x + attn(x)), then ln_2(x + mlp(x)).
    rope, cache and mask go to the attention (see `CausalSelfAttention`).
    """

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.hook_resid_pre = HookPoint()
        self.ln_1, self.ln1 = make_norm(config), NormHooks()  # ln1: ln_1's hook points
        self.attn = CausalSelfAttention(config, layer)
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.ln_2, self.ln2 = make_norm(config), NormHooks()
        self.mlp = MLP(config)
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, x: Tensor, rope=None, cache: KVCache | None = None, mask=None) -> Tensor:
        x = self.hook_resid_pre(x)
        if self.pre_norm:  # ln1(ln_1, h) is ln_1(h), its hook points firing
            h = self.hook_attn_out(self.attn(self.ln1(self.ln_1, x), rope, cache, mask))
            x = self.hook_resid_mid(x + h)
            return self.hook_resid_post(x + self.hook_mlp_out(self.mlp(self.ln2(self.ln_2, x))))
        h = self.hook_attn_out(self.attn(x, rope, cache, mask))
        x = self.hook_resid_mid(self.ln1(self.ln_1, x + h))
        return self.hook_resid_post(self.ln2(self.ln_2, x + self.hook_mlp_out(self.mlp(x))))


class DecoderLM(nn.Module):
    """A decoder-only language model (GPT-2 style unless the config says otherwise).

    Args:
        config: the `ModelConfig`.

    Initialisation follows GPT-2: every Linear and Embedding weight ~ N(0, 0.02), biases 0,
    and the two residual output projections of each block (attn.proj, mlp.proj) ~
    N(0, 0.02 / sqrt(2 * n_layers)), since 2 * n_layers residual branches add into the stream
    (zeros with config.zero_init_proj).

    Hook points (identity `HookPoint`s; attach forward hooks, or use
    `decoderlm.model.hooks.run_with_cache`), for layer l, with TransformerLens's names and
    layouts (its [batch, pos, head_index, d_head] is [B, T, n_heads, head_dim]; keys and
    values keep their n_kv_heads grouped heads, as TransformerLens does):

        hook_embed                   [B, T, d_model]   token embedding (tok_emb(idx))
        hook_pos_embed               [B, T, d_model]   position embedding (learned and
                                     sinusoidal positions only)
        blocks.l.hook_resid_pre      [B, T, d_model]   the block's input (block 0: the sum
                                     of the two above, after embedding dropout)
        blocks.l.ln1.hook_scale      [B, T, 1] float32  ln_1's divisor sqrt(var + eps) (see
                                     `NormHooks`; RMSNorm: sqrt(mean(x^2) + eps))
        blocks.l.ln1.hook_normalized [B, T, d_model] float32  ln_1's input over that divisor
                                     (centred for LayerNorm), before gain and bias
        blocks.l.attn.hook_q         [B, T, n_heads, head_dim]  queries (after QK-norm)
        blocks.l.attn.hook_k/_v      [B, T, n_kv_heads, head_dim]  keys (after QK-norm), values
        blocks.l.attn.hook_rot_q     [B, T, n_heads, head_dim]  q after rope (rope only)
        blocks.l.attn.hook_rot_k     [B, T, n_kv_heads, head_dim]  k after rope (rope only)
        blocks.l.attn.hook_attn_scores [B, n_heads, T, T] float32 q k^T / sqrt(head_dim), -inf
                                     above the diagonal; computed only when a hook is attached
        blocks.l.attn.hook_pattern   [B, n_heads, T, T] float32 softmax probabilities, before
                                     dropout; computed only when a hook is attached
        blocks.l.attn.hook_z         [B, T, n_heads, head_dim]  attention output per head
        blocks.l.hook_attn_out       [B, T, d_model]   the attention's output (after proj)
        blocks.l.hook_resid_mid      [B, T, d_model]   after the attention residual (and ln_1
                                     when post-norm)
        blocks.l.ln2.hook_scale, blocks.l.ln2.hook_normalized   the same for ln_2
        blocks.l.mlp.hook_pre        [B, T, d_ff]      the activation function's input
        blocks.l.mlp.hook_post       [B, T, d_ff]      the hidden layer
        blocks.l.hook_mlp_out        [B, T, d_model]   the MLP's output
        blocks.l.hook_resid_post     [B, T, d_model]   the block's output
        ln_final.hook_scale, ln_final.hook_normalized   the same for ln_f (pre-norm only)
        unembed.hook_in              [B, T, d_model]   what lm_head reads (after ln_f)
        unembed.hook_out             [B, T, vocab_size]  the logits

    Post-norm blocks apply ln_1 after the attention residual (and ln_2 after the MLP's);
    their ln1 / ln2 hook points sit there.

    Attributes:
        eos_token_id: the end-of-text token id of the model's vocabulary (int), or None
            without one; eos_token_ids: all its end-of-text ids (a tuple, eos_token_id first;
            a Hugging Face model may have several). `generate` stops a row at any of them
            unless told otherwise. The model's
            weights do not record it: `set_end_of_text` sets it, called by the loaders with
            the tokenizer's id (`decoderlm.io.load` for every source, `from_pretrained` from
            the directory's tokenizer file, `decoderlm.io.hf_gpt2.load_gpt2` from
            config.json's eos_token_id); a model built from a ModelConfig has None.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.eos_token_id: int | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.tok_emb = nn.Embedding(config.vocab_rows, config.d_model)
        self.pos_emb = None
        if config.pos_encoding == "learned":
            self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        # fixed tables are buffers, rebuilt from the config, not stored in checkpoints
        for name, table in _fixed_tables(config).items():
            self.register_buffer(name, table, persistent=False)
        self.hook_embed = HookPoint()
        if config.pos_encoding in ("learned", "sinusoidal"):
            self.hook_pos_embed = HookPoint()
        self.drop = Dropout(config.dropout_at("embed"))
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layers))
        self.ln_f = make_norm(config) if config.norm_position == "pre" else None
        if self.ln_f is not None:
            self.ln_final = NormHooks()  # ln_f's hook points
        self.unembed = Unembed()
        self.lm_head = nn.Linear(config.d_model, config.vocab_rows, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # a state dict whose two tensors differ never loads silently into tied weights
        self.register_load_state_dict_pre_hook(_resolve_tied_on_load)
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)
            if config.zero_init_proj:
                nn.init.zeros_(block.attn.proj.weight)
                nn.init.zeros_(block.mlp.proj.weight)

    @classmethod
    def unfilled(cls, config: ModelConfig) -> DecoderLM:
        """A model of `config` whose parameters are on the meta device (no memory, no random
        initialisation), for a loader to fill with tensors it has read: `weights.load_state`
        then makes those tensors the parameters instead of copying them, so loading holds
        each weight once. Its fixed tables (rotary or sinusoidal positions) are built on the
        CPU as in a model built from the config."""
        with torch.device("meta"):
            model = cls(config)
        for name, table in _fixed_tables(config).items():
            setattr(model, name, table)
        return model

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def device(self) -> torch.device:
        """The device of the model's weights (that of the unembedding)."""
        return self.lm_head.weight.device

    def _check_input(self, idx: Tensor) -> None:
        c, T = self.config, idx.size(-1)
        problem = None
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            problem = f"idx must be an int64 tensor of shape [B, T], got {idx.dtype} {idx.shape}"
        elif T > c.max_positions:
            problem = (
                f"sequence length T={T} exceeds {c.length_limit}; pass at most "
                f"{c.max_positions} tokens (generate() crops the context)"
            )
        elif T == 0:
            problem = "idx has no tokens (T=0); pass at least one token id"
        elif not torch.compiler.is_compiling():
            lo, hi = (int(v) for v in torch.aminmax(idx))
            if lo < 0 or hi >= c.vocab_size:
                problem = (
                    f"token ids must be in [0, vocab_size={c.vocab_size}), got ids from "
                    f"{lo} to {hi}; was the input encoded with this model's tokenizer?"
                )
        if problem:
            raise UserError(problem)

    def _logits(self, idx: Tensor, pos: Tensor, cache=None, mask=None, last_only=False) -> Tensor:
        """Embed idx [B, T] at positions pos ([T] or [B, T]), run the blocks, unembed."""
        self._check_input(idx)
        x, rope = self.hook_embed(self.tok_emb(idx)), None  # [B, T, d_model]
        if self.config.pos_encoding == "rope":
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]
            rope = (cos[:, None], sin[:, None]) if pos.dim() == 2 else (cos, sin)
        else:  # learned or sinusoidal: [T or B x T, d_model]
            p = self.pos_emb(pos) if self.pos_emb is not None else self.pos_table[pos]
            if self.hook_pos_embed.has_hooks():  # hooks see [B, T, d_model]
                p = self.hook_pos_embed(p.expand_as(x))
            x = x + p
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, rope, cache, mask)
        if last_only:  # decoding needs only the next token's logits
            x = x[:, -1:]
        if self.ln_f is not None:
            x = self.ln_final(self.ln_f, x)
        x = self.unembed.hook_in(x)
        return self.unembed.hook_out(self.to_logits(x))  # [B, T, vocab_size]

    def to_logits(self, x: Tensor) -> Tensor:
        """lm_head(x) without the padded rows: x [..., d_model] (what lm_head reads, after
        ln_f) -> logits [..., vocab_size]. A padded vocabulary's extra rows get no logits, so
        nothing downstream (sampling, loss, evaluation) can produce a padded id. With
        config.logit_softcap c the logits are c * tanh(logits / c), bounded in (-c, c). No
        hook point fires (the logit lens reads intermediate states through it)."""
        logits = self.lm_head(x)  # [..., vocab_rows]
        if self.config.vocab_rows > self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]
        if (cap := self.config.logit_softcap) is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits

    def forward(self, idx: Tensor, targets: Tensor | None = None):
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
            UserError: idx is not [B, T] integer, T is 0 or exceeds max_positions, or an id is
                outside [0, vocab_size).
        """
        logits = self._logits(idx, torch.arange(idx.size(-1), device=idx.device))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
            )
        return logits, loss

    def forward_cached(
        self,
        idx: Tensor,
        cache: KVCache,
        position_ids,
        key_mask=None,
        last_only=False,
        advance: bool = True,
    ):
        """Logits of new tokens given the keys and values of the earlier ones (decoding).

        Args:
            idx: [B, T] int64, the new tokens.
            cache: a `KVCache` holding cache.length earlier positions; the new keys and values
                are appended to it (its length grows by T).
            position_ids: [B, T] int64, each new token's position (< max_positions).
            key_mask: [B, cache.length + T] bool, False for padding (never attended to);
                None means no padding. A fixed cache's one-token step (`KVCache.fix`) takes
                [B, cache.window].
            last_only: compute the logits of the last position only.
            advance: count the new tokens in the cache (`cache.advance`); False leaves that
                to the caller (a compiled step that must not read the cache's length).

        Returns:
            logits [B, T, vocab_size] ([B, 1, vocab_size] with last_only).
        """
        mask = cache.attention_mask(idx.size(1), key_mask)
        logits = self._logits(idx, position_ids, cache, mask, last_only)
        if advance:
            cache.advance(idx.size(1))
        return logits

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Number of unique parameters (a tied matrix counts once); non_embedding=True leaves
        out the learned position table (nanoGPT's convention). Fixed tables are buffers."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.pos_emb.weight.numel() if non_embedding and self.pos_emb is not None else n

    def crop_block_size(self, block_size: int) -> DecoderLM:
        """Shrink the model's context to `block_size` positions, in place (nanoGPT's
        crop_block_size; e.g. GPT-2 at 256 for cheaper fine-tuning). Returns the model.

        The learned position table keeps its first block_size rows (a new Parameter: build the
        optimizer after cropping); the sinusoidal and rotary tables are cut to block_size
        rows; config.block_size and config.max_positions become block_size, so KV caches and
        generation's sliding window follow. Logits of inputs of at most block_size tokens are
        unchanged (attention is causal: position t never sees later ones).

        Raises:
            UserError: block_size is not an integer in 1..config.block_size (a context can
                be cropped, never extended).
        """
        old = self.config
        if (
            isinstance(block_size, bool)
            or not isinstance(block_size, int)
            or not 1 <= block_size <= old.block_size
        ):
            raise UserError(
                f"cannot crop the context to {block_size!r} positions: the model has "
                f"block_size={old.block_size}; give an integer from 1 to {old.block_size}"
            )
        self.config = dataclasses.replace(old, block_size=block_size, max_positions=block_size)
        if self.pos_emb is not None:
            table = self.pos_emb.weight
            self.pos_emb.weight = nn.Parameter(
                table.detach()[:block_size].clone(), requires_grad=table.requires_grad
            )
            self.pos_emb.num_embeddings = block_size
        for name in ("pos_table", "rope_cos", "rope_sin"):
            if hasattr(self, name):
                setattr(self, name, getattr(self, name)[:block_size].clone())
        return self

    def save_pretrained(self, directory: str | Path, extra_config: dict | None = None) -> None:
        """Write model.safetensors and config.json into `directory` (created if missing).

        extra_config: more top-level entries for config.json (the trainer stores its
        TrainConfig under "train").
        """
        save_model(self, directory, extra_config)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        map_location: str = "cpu",
        tie_embeddings: bool | None = None,
        verify: bool = True,
    ) -> DecoderLM:
        """Load a model written by `save_pretrained` (or `decoderlm train`), in eval mode.

        Args:
            directory: the model directory (config.json + model.safetensors).
            map_location: the device to load onto.
            tie_embeddings: override config.json's: False loads tok_emb.weight and
                lm_head.weight as two matrices (a file holding only one starts both from it),
                True shares one. None: as config.json says.
            verify: check model.safetensors against the size and sha256 that config.json
                records (see `decoderlm.model.weights.verify_file`); False skips the check
                (it reads the whole file once more). A directory whose config.json records
                none loads unchecked.

        The model's `eos_token_id` is the <|endoftext|> id of the directory's tokenizer
        file (None without one; `set_end_of_text`). Loading any source, an adapter
        directory included, with its tokenizer: `decoderlm.io.load`.

        Raises:
            MissingFileError: config.json or model.safetensors is missing.
            UserError: the files do not describe a matching model, the weights file differs
                from what config.json records (damaged or truncated: the message names the
                file and both digests or sizes), the tokenizer file is malformed, or the
                model is tied and the file holds two different matrices (see
                `weights.resolve_tied`).
        """
        config, state = read_model_dir(directory, map_location, verify)
        if tie_embeddings is not None:
            config = dataclasses.replace(config, tie_embeddings=tie_embeddings)
        model = load_state(cls.unfilled(config), state, Path(directory) / "model.safetensors")
        model.set_end_of_text(read_end_of_text_id(directory))
        return model.to(map_location).eval()

    def set_end_of_text(self, token_id) -> DecoderLM:
        """Set `eos_token_ids` and `eos_token_id` (the first of them), where `generate` stops
        a row: the end-of-text id of the model's tokenizer (`Tokenizer.eot_token`), or all
        its ids (an iterable: a Hugging Face tokenizer's `eos_token_ids`), or None for a
        vocabulary without one. Every loader sets them here. Returns the model.

        Raises:
            UserError: an id that is not an integer (whether the tokenizer fits the model's
                vocabulary is the loaders' check).
        """
        if token_id is None:
            ids = ()
        elif hasattr(token_id, "__iter__"):
            ids = tuple(dict.fromkeys(token_id))
        else:
            ids = (token_id,)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise UserError(f"an end-of-text id is an integer token id, got {i!r}")
        self.eos_token_ids = ids
        self.eos_token_id = ids[0] if ids else None
        return self


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """A with-block that runs `model` in eval mode (dropout off) and puts its mode back after
    (`model.train(mode)` with the mode it had): what decoding, evaluation and the lens do
    around a forward pass. A model whose modules are all in eval mode already (a model
    prepared for decoding, a served one) is left untouched: `nn.Module.eval` and `train`
    walk and set every submodule, which costs more than checking them (a model of 30 blocks
    has about 1,000 modules). Yields the model."""
    changed = any(module.training for module in model.modules())
    was_training = model.training
    if changed:
        model.eval()
    try:
        yield model
    finally:
        if changed:
            model.train(was_training)


def _fixed_tables(config: ModelConfig) -> dict[str, Tensor]:
    """The position tables a model of `config` computes rather than learns, float32 on the
    CPU: pos_table [max_positions, d_model] (sinusoidal), or rope_cos and rope_sin
    [max_positions, head_dim // 2] (rotary); none for learned positions."""
    if config.pos_encoding == "sinusoidal":
        return {"pos_table": sinusoidal_positions(config.max_positions, config.d_model)}
    if config.pos_encoding == "rope":
        cos, sin = rope_cos_sin(
            config.max_positions, config.head_dim, config.rope_base, config.rope_scaling
        )
        return {"rope_cos": cos, "rope_sin": sin}
    return {}


def _resolve_tied_on_load(model: DecoderLM, state_dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook of a tied model: `resolve_tied` on the keys of this model (an
    untied model loads exactly the tensors given)."""
    if model.config.tie_embeddings:
        resolve_tied(state_dict, True, "the state dict", prefix)
