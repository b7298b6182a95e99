"""Hook points: named activations, read and replaced, free when nothing is attached; and run
directories of the first format (tests/fixtures/run_v0) load and give the same logits."""

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import decoderlm.model.model as model_module
from decoderlm import DecoderLM, load_tokenizer
from decoderlm.generation.generate import generate
from decoderlm.model.hooks import hook_points, hooks, run_with_cache

from conftest import assert_matches_reference, forward_with_attention, halved_random_model

FIXTURES = Path(__file__).parents[1] / "fixtures" / "run_v0"

BLOCK_HOOKS = [
    "hook_resid_pre",
    "ln1.hook_scale",
    "ln1.hook_normalized",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_attn_scores",
    "attn.hook_pattern",
    "attn.hook_z",
    "hook_attn_out",
    "hook_resid_mid",
    "ln2.hook_scale",
    "ln2.hook_normalized",
    "mlp.hook_pre",
    "mlp.hook_post",
    "hook_mlp_out",
    "hook_resid_post",
]
ROPE_HOOKS = ["attn.hook_rot_q", "attn.hook_rot_k"]


@pytest.mark.parametrize("name", ["gpt2-style", "llama-style"])
def test_a_first_format_run_directory_gives_the_same_logits(name):
    # frozen fixture: config.json, model.safetensors and tokenizer.json of a first-format run
    # directory, and the logits, attention maps and greedy tokens expected from it for fixed
    # ids (computed when it was written)
    run = FIXTURES / name
    expected = load_file(str(run / "expected.safetensors"))
    model = DecoderLM.from_pretrained(run)
    assert load_tokenizer(run).vocab_size == model.config.vocab_size
    logits, att = forward_with_attention(model, expected["idx"])
    torch.testing.assert_close(logits, expected["logits"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(att, expected["attention"], atol=1e-6, rtol=1e-6)
    assert_matches_reference(model, expected["idx"])  # and an independent oracle agrees
    greedy = generate(model, expected["idx"][:, :5], 20, do_sample=False)
    assert torch.equal(greedy, expected["greedy"])


@pytest.mark.parametrize(
    "combo", [{}, dict(norm_position="post", pos_encoding="rope", norm="rmsnorm", mlp="swiglu")]
)
def test_every_documented_hook_point_exists_with_its_shape(combo):
    model = halved_random_model(0, **combo)
    c = model.config
    B, T = 2, 7
    rope = c.pos_encoding == "rope"
    block_hooks = BLOCK_HOOKS + (ROPE_HOOKS if rope else [])
    names = ["hook_embed", "unembed.hook_in", "unembed.hook_out"]
    names += ([] if rope else ["hook_pos_embed"]) + (
        ["ln_final.hook_scale", "ln_final.hook_normalized"] if c.norm_position == "pre" else []
    )
    names += [f"blocks.{i}.{h}" for i in range(c.n_layers) for h in block_hooks]
    assert sorted(hook_points(model)) == sorted(names)
    (logits, _), cache = run_with_cache(model, torch.randint(0, 65, (B, T)))
    heads = (B, T, c.n_heads, c.head_dim)  # TransformerLens's [batch, pos, head_index, d_head]
    shapes = {
        "hook_embed": (B, T, c.d_model),
        "hook_pos_embed": (B, T, c.d_model),
        "hook_attn_out": (B, T, c.d_model),
        "hook_mlp_out": (B, T, c.d_model),
        "attn.hook_rot_q": heads,
        "attn.hook_rot_k": heads,
        "unembed.hook_in": (B, T, c.d_model),
        "unembed.hook_out": (B, T, c.vocab_size),
        "ln1.hook_scale": (B, T, 1),
        "ln2.hook_scale": (B, T, 1),
        "ln_final.hook_scale": (B, T, 1),
        "ln1.hook_normalized": (B, T, c.d_model),
        "ln2.hook_normalized": (B, T, c.d_model),
        "ln_final.hook_normalized": (B, T, c.d_model),
        "hook_resid_pre": (B, T, c.d_model),
        "hook_resid_mid": (B, T, c.d_model),
        "hook_resid_post": (B, T, c.d_model),
        "attn.hook_q": heads,
        "attn.hook_k": heads,
        "attn.hook_v": heads,
        "attn.hook_z": heads,
        "attn.hook_attn_scores": (B, c.n_heads, T, T),
        "attn.hook_pattern": (B, c.n_heads, T, T),
        "mlp.hook_pre": (B, T, c.d_ff),
        "mlp.hook_post": (B, T, c.d_ff),
    }
    for name in names:
        suffix = name.split(".", 2)[-1] if name.startswith("blocks.") else name
        assert cache[name].shape == shapes[suffix], name
    # the residual stream is one stream: each block's output is the next block's input
    for layer in range(c.n_layers - 1):
        assert torch.equal(
            cache[f"blocks.{layer}.hook_resid_post"], cache[f"blocks.{layer + 1}.hook_resid_pre"]
        )
    # the unembedding reads unembed.hook_in and writes unembed.hook_out, the logits
    torch.testing.assert_close(model.lm_head(cache["unembed.hook_in"]), logits)
    assert torch.equal(cache["unembed.hook_out"], logits)
    pattern = cache["blocks.0.attn.hook_pattern"]
    assert pattern.dtype == torch.float32 and torch.all(pattern.triu(1) == 0)
    torch.testing.assert_close(pattern.sum(-1), torch.ones(B, c.n_heads, T))
    # the scores are what the softmax reads: -inf exactly where the pattern is 0 by causality
    scores = cache["blocks.0.attn.hook_attn_scores"]
    assert torch.equal(
        scores.isneginf(), torch.ones(T, T, dtype=torch.bool).triu(1).expand_as(scores)
    )
    torch.testing.assert_close(scores.softmax(-1), pattern)
    # each norm's output is hook_normalized times its gain (plus its bias)
    for layer, block in enumerate(model.blocks):
        for part, norm in (("ln1", block.ln_1), ("ln2", block.ln_2)):
            normalized = cache[f"blocks.{layer}.{part}.hook_normalized"]
            x = normalized * cache[f"blocks.{layer}.{part}.hook_scale"]  # the centred input
            bias = 0 if getattr(norm, "bias", None) is None else norm.bias
            torch.testing.assert_close(norm(x), normalized * norm.weight + bias)


def test_a_hook_that_zeroes_z_equals_a_model_with_zero_values():
    # oracle: zero value projections give z = 0 in every head of layer 0
    model = halved_random_model(1)
    idx = torch.randint(0, 65, (2, 9))
    with hooks(model, {"blocks.0.attn.hook_z": lambda z, name: torch.zeros_like(z)}):
        patched, _ = model(idx)
    ablated = copy.deepcopy(model)
    d = model.config.d_model
    with torch.no_grad():
        ablated.blocks[0].attn.qkv.weight[2 * d :] = 0
        ablated.blocks[0].attn.qkv.bias[2 * d :] = 0
    torch.testing.assert_close(patched, ablated(idx)[0])
    assert not torch.allclose(patched, model(idx)[0])  # and the hooks are gone again
    assert not any(p.has_hooks() for p in hook_points(model).values())


@pytest.mark.parametrize("hook", ["hook_pattern", "hook_attn_scores"])
def test_the_scores_are_computed_only_when_a_hook_asks_for_them(monkeypatch, hook):
    model = halved_random_model(2)
    calls = []
    original = model_module.attention_scores
    monkeypatch.setattr(
        model_module, "attention_scores", lambda q, k: calls.append(1) or original(q, k)
    )
    idx = torch.randint(0, 65, (1, 8))
    plain, _ = model(idx)
    assert calls == []
    (hooked, _), cache = run_with_cache(model, idx, [f"blocks.1.attn.{hook}"])
    assert len(calls) == 1 and list(cache) == [f"blocks.1.attn.{hook}"]
    torch.testing.assert_close(hooked, plain, atol=1e-5, rtol=1e-5)
    # the written-out training kernel is for training mode only: evaluation stays fused
    for block in model.blocks:
        block.attn.impl = "explicit"
    model(idx)
    assert len(calls) == 1
    model.train()(idx)
    assert len(calls) == 1 + model.config.n_layers


def test_a_replaced_pattern_is_the_one_attention_uses():
    # uniform causal attention written by a hook: z of head h at t is the mean of v[..., :t+1]
    model = halved_random_model(3)
    idx = torch.randint(0, 65, (1, 6))
    T = idx.size(1)
    uniform = torch.ones(T, T).tril() / torch.arange(1, T + 1)[:, None]
    seen = {}
    with hooks(
        model,
        {
            "blocks.0.attn.hook_pattern": lambda a, n: uniform.expand_as(a),
            "blocks.0.attn.hook_v": lambda v, n: seen.setdefault("v", v),
            "blocks.0.attn.hook_z": lambda z, n: seen.setdefault("z", z),
        },
    ):
        model(idx)
    # v and z are [B, T, n_heads, head_dim]: the mean runs over the positions, axis 1
    expected = seen["v"].cumsum(1) / torch.arange(1, T + 1)[:, None, None]
    torch.testing.assert_close(seen["z"], expected)


def test_unknown_hook_names_are_refused():
    with pytest.raises(ValueError, match="no hook point named"):
        run_with_cache(
            halved_random_model(0),
            torch.zeros(1, 3, dtype=torch.long),
            ["blocks.0.attn.hook_nothing"],
        )


def test_names_filter_keeps_only_what_it_names_and_logits_are_the_models():
    model = halved_random_model(4)
    idx = torch.randint(0, 65, (2, 9))
    plain, _ = model(idx)
    (logits, _), cache = run_with_cache(model, idx, names_filter=lambda n: n.endswith("resid_mid"))
    assert list(cache) == ["blocks.0.hook_resid_mid", "blocks.1.hook_resid_mid"]
    assert torch.equal(logits, plain)  # reading hooks change nothing, bit for bit
    _, cache = run_with_cache(model, idx, "hook_embed")
    assert list(cache) == ["hook_embed"]
    _, cache = run_with_cache(
        model, idx, ["blocks.0.hook_resid_pre", "hook_resid_post", "blocks.1.mlp.hook_post"]
    )
    assert list(cache) == [
        "blocks.0.hook_resid_pre",
        "blocks.0.hook_resid_post",
        "blocks.1.mlp.hook_post",
        "blocks.1.hook_resid_post",
    ]
    assert torch.equal(cache["hook_resid_post", 1], cache["blocks.1.hook_resid_post"])
    stream = cache.accumulated_resid()
    assert stream.shape == (3, 2, 9, 64)
    assert torch.equal(stream[0], cache["blocks.0.hook_resid_pre"])
    assert torch.equal(stream[2], cache["blocks.1.hook_resid_post"])


def test_hooks_take_predicates_replace_values_and_go_away_after_an_exception():
    model = halved_random_model(5)
    idx = torch.randint(0, 65, (1, 6))
    seen = []
    with pytest.raises(RuntimeError, match="inside"):
        with hooks(model, [(lambda n: n.endswith("hook_resid_pre"), lambda x, n: seen.append(n))]):
            model(idx)
            raise RuntimeError("inside the block")
    assert seen == ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"]
    assert not any(p.has_hooks() for p in hook_points(model).values())
    with pytest.raises(ValueError, match="no hook point named"):  # nothing half-attached
        with hooks(model, [("hook_embed", print), ("hook_nothing", print)]):
            pass
    assert not any(p.has_hooks() for p in hook_points(model).values())


def test_a_zeroed_last_residual_gives_the_unembedding_of_the_final_norm_of_zeros():
    # LayerNorm of a zero vector is its bias (x - mean = 0), so every position's logits are
    # lm_head.weight @ ln_f.bias
    model = halved_random_model(6)
    idx = torch.randint(0, 65, (2, 7))
    last = f"blocks.{model.config.n_layers - 1}.hook_resid_post"
    with hooks(model, [(last, lambda x, n: torch.zeros_like(x))]):
        logits, _ = model(idx)
    expected = model.lm_head.weight @ model.ln_f.bias
    torch.testing.assert_close(logits, expected.expand_as(logits).detach())


def test_cached_activations_of_one_block_equal_the_numpy_reference():
    import numpy as np

    from decoderlm.model import reference as ref

    model = halved_random_model(7)
    idx = torch.randint(0, 65, (2, 8))
    _, cache = run_with_cache(model, idx)
    p = {k: v.double().numpy() for k, v in model.state_dict().items()}
    x = p["tok_emb.weight"][idx.numpy()] + p["pos_emb.weight"][:8]
    h = ref.layer_norm(x, p["blocks.0.ln_1.weight"], p["blocks.0.ln_1.bias"])
    attn_out, att = ref.causal_self_attention(h, p, "blocks.0.attn", model.config.n_heads)
    mid = x + attn_out
    pre = ref.layer_norm(mid, p["blocks.0.ln_2.weight"], p["blocks.0.ln_2.bias"])
    pre = pre @ p["blocks.0.mlp.fc.weight"].T + p["blocks.0.mlp.fc.bias"]
    post = ref.gelu(pre)
    out = mid + post @ p["blocks.0.mlp.proj.weight"].T + p["blocks.0.mlp.proj.bias"]
    expected = {
        "hook_embed": p["tok_emb.weight"][idx.numpy()],
        "hook_pos_embed": np.broadcast_to(p["pos_emb.weight"][:8], x.shape),
        "blocks.0.hook_resid_pre": x,
        "blocks.0.attn.hook_pattern": att,
        "blocks.0.hook_resid_mid": mid,
        "blocks.0.mlp.hook_pre": pre,
        "blocks.0.mlp.hook_post": post,
        "blocks.0.hook_resid_post": out,
    }
    for name, value in expected.items():
        np.testing.assert_allclose(cache[name].double().numpy(), value, atol=1e-5, err_msg=name)


def test_the_cache_at_position_t_ignores_later_tokens():
    model = halved_random_model(8)
    idx = torch.randint(0, 65, (1, 10))
    changed = idx.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % 65
    _, a = run_with_cache(model, idx)
    _, b = run_with_cache(model, changed)
    for name in a:
        if name.endswith(("hook_pattern", "hook_attn_scores")):
            torch.testing.assert_close(a[name][..., :6, :6], b[name][..., :6, :6], msg=name)
        else:
            # positions are axis 1: [B, T, d] and [B, T, n_heads, head_dim] alike
            torch.testing.assert_close(a[name][:, :6], b[name][:, :6], msg=name)
        if name != "hook_pos_embed":  # the position embedding does not depend on the tokens
            assert not torch.allclose(a[name], b[name]), name  # the later positions changed


def test_replaced_scores_are_the_ones_the_softmax_reads():
    # zero scores at every allowed key are uniform causal attention: the same logits as a
    # hook that writes the uniform pattern itself
    model = halved_random_model(3)
    idx = torch.randint(0, 65, (1, 6))
    T = idx.size(1)
    uniform = torch.ones(T, T).tril() / torch.arange(1, T + 1)[:, None]

    def flat(scores, name):
        return torch.where(scores.isneginf(), scores, torch.zeros_like(scores))

    with hooks(model, {"blocks.0.attn.hook_attn_scores": flat}):
        by_scores, _ = model(idx)
    with hooks(model, {"blocks.0.attn.hook_pattern": lambda a, n: uniform.expand_as(a)}):
        by_pattern, _ = model(idx)
    torch.testing.assert_close(by_scores, by_pattern)
    assert not torch.allclose(by_scores, model(idx)[0])


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_a_replaced_norm_scale_is_the_one_the_norm_divides_by(norm):
    # doubling ln_final's divisor halves what the gain multiplies: the same logits as
    # halving ln_f's gain (and keeping its bias)
    model = halved_random_model(5, norm=norm)
    idx = torch.randint(0, 65, (2, 7))
    with hooks(model, {"ln_final.hook_scale": lambda s, n: 2 * s}):
        doubled, _ = model(idx)
    halved = copy.deepcopy(model)
    with torch.no_grad():
        halved.ln_f.weight.mul_(0.5)
    torch.testing.assert_close(doubled, halved(idx)[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(doubled, model(idx)[0], atol=1e-3)
