"""The ModelConfig options: positions (learned, sinusoidal, rope), pre/post norm, LayerNorm /
RMSNorm, GELU (exact / tanh) / SwiGLU MLPs, bias, tying."""

import math

import pytest
import torch

from decoderlm.model.positions import apply_rope, rope_cos_sin, sinusoidal_positions


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
