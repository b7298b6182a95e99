"""The ModelConfig options of modern training recipes: ReLU^2 MLP, QK-norm, zero-initialised
output projections, logit soft-capping. Each against the NumPy reference or a closed form."""

import pytest
import torch

from decoderlm import DecoderLM
from decoderlm.io.hf_gpt2 import save_gpt2
from decoderlm.model.analysis import count_parameters
from decoderlm.model.hooks import run_with_cache
from decoderlm.model.kv_cache import KVCache

from conftest import assert_matches_reference, halved_random_model, randomize, tiny_config

OPTIONS = [
    dict(mlp="relu2"),
    dict(mlp="relu2", norm="rmsnorm", bias=False, norm_position="post"),
    dict(qk_norm=True),
    dict(qk_norm=True, pos_encoding="rope", norm="rmsnorm"),
    dict(logit_softcap=2.0),
    dict(mlp="relu2", qk_norm=True, logit_softcap=3.0, pos_encoding="rope", zero_init_proj=True),
]


@pytest.mark.parametrize("combo", OPTIONS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_recipe_options_match_the_numpy_reference(combo):
    model = halved_random_model(3, **combo)
    assert_matches_reference(model, torch.randint(0, 65, (2, 32)))
    cfg = tiny_config(**combo)
    assert count_parameters(cfg)["total"] == DecoderLM(cfg).num_parameters()


def test_relu2_mlp_is_the_square_of_relu():
    model = randomize(DecoderLM(tiny_config(mlp="relu2")).eval())
    idx = torch.randint(0, 65, (1, 16))
    _, cache = run_with_cache(model, idx, ["blocks.0.mlp.hook_pre", "blocks.0.mlp.hook_post"])
    pre, post = cache["blocks.0.mlp.hook_pre"], cache["blocks.0.mlp.hook_post"]
    assert (pre < 0).any() and (pre > 0).any()
    assert torch.equal(post, torch.where(pre > 0, pre * pre, torch.zeros_like(pre)))


def test_qk_norm_gives_unit_rms_queries_and_keys():
    model = randomize(DecoderLM(tiny_config(qk_norm=True, pos_encoding="rope")).eval())
    idx = torch.randint(0, 65, (2, 32))
    _, cache = run_with_cache(model, idx, ["blocks.1.attn.hook_q", "blocks.1.attn.hook_k"])
    for name in cache:  # rope rotates pairs, so the RMS over head_dim stays 1
        rms = cache[name].pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.ones_like(rms), atol=1e-4), name


def test_soft_cap_bounds_the_logits_and_is_c_tanh_of_the_uncapped_ones():
    capped = randomize(DecoderLM(tiny_config(logit_softcap=5.0)).eval())
    with torch.no_grad():
        for p in capped.parameters():
            p.mul_(20.0)
    plain = DecoderLM(tiny_config()).eval()
    plain.load_state_dict(capped.state_dict())
    idx = torch.randint(0, 65, (2, 32))
    raw, bounded = plain(idx)[0], capped(idx)[0]
    assert raw.abs().max() > 50.0 and bounded.abs().max() <= 5.0
    assert torch.allclose(bounded, 5.0 * torch.tanh(raw / 5.0), atol=1e-5)


def test_zero_initialised_projections_make_every_block_the_identity():
    torch.manual_seed(0)
    model = DecoderLM(tiny_config(zero_init_proj=True)).eval()
    for block in model.blocks:
        assert not block.attn.proj.weight.any() and not block.mlp.proj.weight.any()
    names = [f"blocks.{i}.{h}" for i in range(2) for h in ("hook_resid_pre", "hook_resid_post")]
    _, cache = run_with_cache(model, torch.randint(0, 65, (1, 16)), names)
    for i in range(2):
        assert torch.equal(
            cache[f"blocks.{i}.hook_resid_pre"], cache[f"blocks.{i}.hook_resid_post"]
        )
    torch.manual_seed(0)
    default = DecoderLM(tiny_config())
    assert default.blocks[0].mlp.proj.weight.std() > 0  # the option, not the default, zeroes


def test_cached_decoding_matches_the_full_forward_with_every_option():
    model = halved_random_model(1, **OPTIONS[-1])
    idx = torch.randint(0, 65, (1, 12))
    full, _ = model(idx)
    cache = KVCache(model.config, 1, "cpu", torch.float32)
    first = model.forward_cached(idx[:, :8], cache, torch.arange(8)[None])
    rest = model.forward_cached(idx[:, 8:], cache, torch.arange(8, 12)[None])
    assert torch.allclose(torch.cat([first, rest], 1), full, atol=1e-5)


def test_bad_recipe_options_are_named():
    with pytest.raises(ValueError, match="logit_softcap must be a finite number > 0"):
        tiny_config(logit_softcap=0.0)
    with pytest.raises(ValueError, match="qk_norm must be true or false"):
        tiny_config(qk_norm="yes")


def test_gpt2_export_refuses_what_gpt2_cannot_express(tmp_path):
    for combo in (dict(qk_norm=True), dict(logit_softcap=30.0), dict(mlp="relu2")):
        with pytest.raises(ValueError, match="only GPT-2-shaped models"):
            save_gpt2(DecoderLM(tiny_config(**combo)), tmp_path)


def test_dropout_can_be_placed_per_site():
    model = DecoderLM(tiny_config(dropout=0.1, attn_dropout=0.3, resid_dropout=0.0))
    assert model.drop.p == 0.1  # embed_dropout unset: dropout
    for block in model.blocks:
        assert block.attn.dropout == 0.3
        assert block.attn.resid_dropout.p == 0.0 and block.mlp.dropout.p == 0.0
    only_embed = DecoderLM(tiny_config(embed_dropout=0.5)).train()
    idx = torch.randint(0, 65, (1, 16))
    names = ["hook_embed", "hook_pos_embed", "blocks.0.hook_resid_pre"]
    _, cache = run_with_cache(only_embed, idx, names)
    embed = cache["hook_embed"] + cache["hook_pos_embed"]  # tokens + positions, before dropout
    dropped = cache["blocks.0.hook_resid_pre"]
    kept = dropped != 0
    assert (~kept).any() and torch.allclose(dropped[kept], 2 * embed[kept])  # scaled by 1/(1-p)
    with pytest.raises(ValueError, match=r"attn_dropout must be a finite number in \[0.0, 1.0\)"):
        tiny_config(attn_dropout=1.0)
