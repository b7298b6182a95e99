"""The ModelConfig options: positions (learned, sinusoidal, rope), pre/post norm, LayerNorm /
RMSNorm, GELU (exact / tanh) / SwiGLU MLPs, bias, tying."""

import math

import pytest
import torch

from decoderlm.model.positions import (
    apply_rope,
    rope_cos_sin,
    rope_half_to_interleaved,
    rope_interleaved_to_half,
    sinusoidal_positions,
)


def test_sinusoidal_table_matches_the_formula():
    pe = sinusoidal_positions(50, 64)
    for pos, i in [(0, 0), (1, 0), (7, 3), (49, 31), (20, 10)]:
        angle = pos / 10000 ** (2 * i / 64)
        assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert pe[1, 0].item() == pytest.approx(0.841471, abs=1e-6)  # sin(1)


def test_rope_is_a_rotation_that_depends_only_on_relative_position():
    # a rotation: the identity at position 0, norms kept, and the q.k score depends only on
    # the distance between the two positions
    torch.manual_seed(0)
    cos, sin = rope_cos_sin(32, 16)
    q, k = torch.randn(2, 1, 1, 1, 16).unbind(0)  # the same q and k at every position
    q = q.expand(1, 1, 32, 16).contiguous()
    k = k.expand(1, 1, 32, 16).contiguous()
    rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert torch.allclose(rq[..., 0, :], q[..., 0, :], atol=1e-7)  # identity at position 0
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-6)

    def score(m, n):
        return (rq[..., m, :] * rk[..., n, :]).sum().item()

    assert score(5, 3) == pytest.approx(score(12, 10), abs=1e-5)
    assert score(5, 3) != pytest.approx(score(5, 4), abs=1e-3)


def test_interleaved_rope_weights_convert_to_the_half_split_layout():
    # rotary embeddings pair dimensions either as adjacent pairs (interleaved) or as the two
    # halves; weights of one layout give the same scores in the other once the q/k rows are
    # permuted
    torch.manual_seed(0)
    n_heads, head_dim, d_in, T = 2, 16, 24, 12
    Wq, Wk = torch.randn(2, n_heads * head_dim, d_in).unbind(0)
    x = torch.randn(T, d_in)
    cos, sin = rope_cos_sin(T, head_dim)

    def interleaved(W):  # rotate pairs (2j, 2j + 1) by m * theta_j, written out
        h = (x @ W.T).view(T, n_heads, head_dim // 2, 2)
        a, b = h[..., 0], h[..., 1]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.stack([a * c - b * s, a * s + b * c], dim=-1).view(T, n_heads, head_dim)

    def half(W):
        h = (x @ rope_interleaved_to_half(W, n_heads).T).view(T, n_heads, head_dim)
        return apply_rope(h.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)

    scores_interleaved = torch.einsum("thd,shd->hts", interleaved(Wq), interleaved(Wk))
    scores_half = torch.einsum("thd,shd->hts", half(Wq), half(Wk))
    assert torch.allclose(scores_interleaved, scores_half, atol=1e-4)
    assert not torch.allclose(
        scores_interleaved,
        torch.einsum(
            "thd,shd->hts",
            *(
                apply_rope((x @ W.T).view(T, n_heads, head_dim).transpose(0, 1)[None], cos, sin)[
                    0
                ].transpose(0, 1)
                for W in (Wq, Wk)
            ),
        ),
        atol=1e-2,
    )


def _rope_interleaved(x, cos, sin):
    """Rotary positions in llama.cpp's interleaved layout: features 2j and 2j + 1 form pair j."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2)


def test_rope_permutation_keeps_scores():
    """q and k rows permuted by rope_half_to_interleaved and rotated in the interleaved layout
    give the scores of the original rows rotated in the half-split layout, at every pair of
    positions; the permutation is the inverse of rope_interleaved_to_half."""
    n_heads, head_dim, d, T = 2, 16, 32, 12
    g = torch.Generator().manual_seed(0)
    wq, wk, x = (torch.randn(n, d, generator=g) for n in (d, d, T))
    x = x[:T]
    cos, sin = rope_cos_sin(T, head_dim)

    def scores(wq, wk, rope):
        q, k = ((x @ w.T).view(T, n_heads, head_dim).transpose(0, 1) for w in (wq, wk))
        return rope(q, cos, sin) @ rope(k, cos, sin).transpose(-1, -2)

    half = scores(wq, wk, apply_rope)
    perm = [rope_half_to_interleaved(w, n_heads) for w in (wq, wk)]
    assert torch.allclose(scores(*perm, _rope_interleaved), half, atol=1e-4)
    assert torch.equal(rope_interleaved_to_half(perm[0], n_heads), wq)
    assert not torch.allclose(scores(wq, wk, _rope_interleaved), half, atol=1e-2)
