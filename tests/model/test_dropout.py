"""The CPU dropout (`decoderlm.model.dropout`): its mask against the binomial distribution it
must follow, its scale against the closed form, its gradient, and its reproducibility."""

import math

import pytest
import torch
import torch.nn.functional as F

from decoderlm.model.dropout import Dropout, dropout, keep_probability

N = 1 << 20


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_element_is_kept_with_the_stated_probability_and_scaled_by_its_inverse(p, dtype):
    # the kept fraction of 2^20 elements is within 5 standard deviations of the binomial's
    # mean, for every one of the four 16-bit lanes a 64-bit draw gives, and each kept
    # element is x / keep_probability(p) (so E[out] = x), each dropped one 0
    torch.manual_seed(0)
    x = torch.rand(N, dtype=dtype) + 1.0  # no zeros: a zero out is a dropped element
    out = dropout(x, p)
    keep = keep_probability(p)
    assert abs(keep - (1 - p)) <= 2**-17
    kept = out != 0
    sd = math.sqrt(keep * (1 - keep) / (N // 4))
    for lane in range(4):
        assert abs(kept[lane::4].double().mean().item() - keep) < 5 * sd
    expected = (x * (1.0 / keep))[kept]
    assert out.dtype == dtype and torch.equal(out[kept], expected)


def test_neighbouring_elements_are_dropped_independently():
    # both of two neighbours (two lanes of one draw, or of two draws) dropped with
    # probability (1 - keep)^2, within 5 standard deviations
    torch.manual_seed(1)
    dropped = dropout(torch.ones(N), 0.5) == 0
    q = (1 - keep_probability(0.5)) ** 2
    for a, b in ((dropped[0::4], dropped[1::4]), (dropped[3::4], dropped[4::4])):
        n = min(len(a), len(b))
        both = (a[:n] & b[:n]).double().mean().item()
        assert abs(both - q) < 5 * math.sqrt(q * (1 - q) / n)


def test_the_gradient_is_the_mask_times_the_scale():
    torch.manual_seed(2)
    x = torch.randn(64, 96, requires_grad=True)
    out = dropout(x, 0.2)
    out.sum().backward()
    mask = (out != 0).float()
    assert torch.equal(x.grad, mask * (1.0 / keep_probability(0.2)))


def test_the_masks_follow_the_seed_and_eval_mode_drops_nothing():
    x = torch.randn(8, 32, 128)
    layer = Dropout(0.1)
    torch.manual_seed(3)
    first = layer(x)
    torch.manual_seed(3)
    assert torch.equal(layer(x), first)
    assert not torch.equal(layer(x), first)  # the generator moved on: a new mask
    layer.eval()
    assert layer(x) is x
    assert dropout(x, 0.0) is x and dropout(x, 0.3, training=False) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))


def test_a_probability_outside_0_1_is_refused_as_by_torch():
    x = torch.ones(3)
    for p in (-0.1, 1.5):
        with pytest.raises(ValueError, match="between 0 and 1"):
            dropout(x, p)
        with pytest.raises(ValueError, match="between 0 and 1"):
            F.dropout(x, p)
