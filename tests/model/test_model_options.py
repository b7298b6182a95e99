"""The ModelConfig options: positions (learned, sinusoidal, rope), pre/post norm, LayerNorm /
RMSNorm, GELU (exact / tanh) / SwiGLU MLPs, bias, tying."""

import itertools

import pytest
import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.model.analysis import count_parameters
from decoderlm.model.model import MLP

from conftest import (
    assert_matches_reference,
    forward_with_attention,
    halved_random_model,
    randomize,
    tiny_config,
    tiny_model,
)

POS = ("learned", "sinusoidal", "rope")
BODY = (
    {"norm": "layernorm", "mlp": "gelu", "activation": "gelu"},
    {"norm": "rmsnorm", "mlp": "swiglu", "d_ff": 96},
    {"norm": "layernorm", "mlp": "gelu", "activation": "gelu_tanh"},
)
COMBOS = [
    dict(pos_encoding=pos, norm_position=where, bias=(i % 2 == 0), **body)
    for i, (pos, where, body) in enumerate(itertools.product(POS, ("pre", "post"), BODY))
]


def _name(combo):
    return "-".join(str(v) for v in combo.values())


@pytest.mark.parametrize("combo", COMBOS, ids=_name)
def test_numpy_reference_covers_every_option(combo):
    model = halved_random_model(5, **combo)
    idx = torch.randint(0, 65, (2, 32))
    logits = assert_matches_reference(model, idx)
    explicit, _ = forward_with_attention(model, idx)
    assert torch.allclose(logits, explicit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("combo", COMBOS, ids=_name)
def test_closed_form_count_equals_the_modules_for_every_option(combo):
    cfg = tiny_config(**combo)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    assert count_parameters(cfg)["total"] == model.num_parameters()
    assert count_parameters(cfg)["non_embedding"] == model.num_parameters(non_embedding=True)


@pytest.mark.parametrize("pos", ["sinusoidal", "rope"])
def test_fixed_positions_have_no_parameters(pos):
    # sinusoidal and rotary positions are computed, not learned: the tiny model has 104,256
    # parameters with either, and the non-embedding count (no position table to subtract)
    # is the same number
    model = tiny_model(pos_encoding=pos)
    assert model.num_parameters() == 104_256 == model.num_parameters(non_embedding=True)
    assert count_parameters(model.config)["total"] == 104_256
    assert not any("pos" in k or "rope" in k for k in model.state_dict())


@pytest.mark.parametrize("pos", POS)
def test_causality_for_every_position_encoding(pos):
    model = randomize(tiny_model(pos_encoding=pos))
    idx = torch.randint(0, 65, (2, 32))
    changed = idx.clone()
    changed[:, 11:] = (changed[:, 11:] + 1) % 65
    assert torch.allclose(model(idx)[0][:, :11], model(changed)[0][:, :11], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "activation,expected",
    [("gelu_tanh", (0.841192, -0.158808, -0.003637)), ("gelu", (0.841345, -0.158655, -0.004050))],
)
def test_gelu_variants_give_the_published_values(activation, expected):
    # GPT-2's tanh GELU and the exact erf GELU differ by up to ~4e-4; a 1-wide MLP with unit
    # weights is the activation itself, checked against each one's published values
    mlp = MLP(
        ModelConfig(
            vocab_size=2,
            block_size=2,
            n_layers=1,
            n_heads=1,
            d_model=1,
            d_ff=1,
            activation=activation,
        )
    )
    with torch.no_grad():
        for p in mlp.parameters():
            p.fill_(1.0 if p.dim() == 2 else 0.0)
    out = mlp(torch.tensor([[1.0], [-1.0], [-3.0]])).squeeze(-1).tolist()
    assert out == pytest.approx(expected, abs=1e-6)


def test_options_survive_save_and_load(tmp_path):
    combo = dict(
        pos_encoding="rope",
        norm_position="post",
        norm="rmsnorm",
        mlp="swiglu",
        d_ff=96,
        bias=False,
        activation="gelu_tanh",
        tie_embeddings=False,
    )
    model = randomize(tiny_model(**combo))
    model.save_pretrained(tmp_path)
    again = DecoderLM.from_pretrained(tmp_path)
    assert again.config == model.config
    idx = torch.randint(0, 65, (1, 32))
    assert torch.equal(model(idx)[0], again(idx)[0])


@pytest.mark.parametrize("where", ["pre", "post"])
def test_pre_and_post_norm_both_train(where):
    torch.manual_seed(0)
    model = DecoderLM(tiny_config(norm_position=where, pos_encoding="sinusoidal")).train()
    x = torch.randint(0, 65, (4, 32))
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(80):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(pos_encoding="alibi"),
            r"pos_encoding must be one of \['learned', 'sinusoidal', 'rope'\]",
        ),
        (dict(norm_position="sandwich"), "norm_position must be one of"),
        (dict(mlp="relu"), "mlp must be one of"),
        (dict(pos_encoding="rope", d_model=12, n_heads=4), "rope needs an even head_dim"),
    ],
)
def test_bad_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**kwargs)


def test_swiglu_default_width_follows_llama():
    assert ModelConfig(d_model=4096, n_heads=32, mlp="swiglu").d_ff == 11008
