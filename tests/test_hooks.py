"""Hook points: named activations, read and replaced, free when nothing is attached; and run
directories written before the hook points existed still load and give the same logits."""

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import decoderlm.model as model_module
from decoderlm import DecoderLM, load_tokenizer
from decoderlm.generate import generate
from decoderlm.hooks import hook_points, hooks, run_with_cache

from conftest import assert_matches_reference, forward_with_attention, halved_random_model

FIXTURES = Path(__file__).parent / "fixtures" / "run_v0"

BLOCK_HOOKS = [
    "hook_resid_pre",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_pattern",
    "attn.hook_z",
    "hook_resid_mid",
    "mlp.hook_pre",
    "mlp.hook_post",
    "hook_resid_post",
]


@pytest.mark.parametrize("name", ["gpt2-style", "llama-style"])
def test_a_run_directory_written_before_the_redesign_gives_the_same_logits(name):
    # frozen fixture: config.json, model.safetensors and tokenizer.json written by
    # `decoderlm train` before the hook points existed, and the logits, attention maps and
    # greedy tokens that code computed for fixed ids
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
    names = ["hook_embed", "hook_normalized"] + [
        f"blocks.{i}.{h}" for i in range(c.n_layers) for h in BLOCK_HOOKS
    ]
    assert sorted(hook_points(model)) == sorted(names)
    (logits, _), cache = run_with_cache(model, torch.randint(0, 65, (B, T)))
    heads = (B, c.n_heads, T, c.head_dim)
    shapes = {
        "hook_embed": (B, T, c.d_model),
        "hook_normalized": (B, T, c.d_model),
        "hook_resid_pre": (B, T, c.d_model),
        "hook_resid_mid": (B, T, c.d_model),
        "hook_resid_post": (B, T, c.d_model),
        "attn.hook_q": heads,
        "attn.hook_k": heads,
        "attn.hook_v": heads,
        "attn.hook_z": heads,
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
    # the unembedding reads hook_normalized
    torch.testing.assert_close(model.lm_head(cache["hook_normalized"]), logits)
    pattern = cache["blocks.0.attn.hook_pattern"]
    assert pattern.dtype == torch.float32 and torch.all(pattern.triu(1) == 0)
    torch.testing.assert_close(pattern.sum(-1), torch.ones(B, c.n_heads, T))


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


def test_the_pattern_is_computed_only_when_a_hook_asks_for_it(monkeypatch):
    model = halved_random_model(2)
    calls = []
    original = model_module.attention_pattern
    monkeypatch.setattr(
        model_module, "attention_pattern", lambda q, k: calls.append(1) or original(q, k)
    )
    idx = torch.randint(0, 65, (1, 8))
    plain, _ = model(idx)
    assert calls == []
    (hooked, _), cache = run_with_cache(model, idx, ["blocks.1.attn.hook_pattern"])
    assert len(calls) == 1 and list(cache) == ["blocks.1.attn.hook_pattern"]
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
    expected = seen["v"].cumsum(-2) / torch.arange(1, T + 1)[:, None]
    torch.testing.assert_close(seen["z"], expected)


def test_unknown_hook_names_are_refused():
    with pytest.raises(ValueError, match="no hook point named"):
        run_with_cache(
            halved_random_model(0),
            torch.zeros(1, 3, dtype=torch.long),
            ["blocks.0.attn.hook_nothing"],
        )
