import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from decoderlm import DecoderLM, ModelConfig
from decoderlm.model import reference
from decoderlm.model.analysis import count_parameters
from decoderlm.model.model import eval_mode

from conftest import (
    assert_matches_reference,
    causal_attention,
    forward_with_attention,
    halved_random_model,
    randomize,
    tiny_config,
    tiny_model,
)


def test_forward_shapes_and_loss_is_mean_cross_entropy(tiny):
    idx = torch.randint(0, 65, (3, 20))
    targets = torch.randint(0, 65, (3, 20))
    logits, loss = tiny(idx, targets)
    assert logits.shape == (3, 20, 65)
    logp = torch.log_softmax(logits.double(), -1)
    expected = -logp.gather(-1, targets[..., None]).mean()
    assert loss.dtype == torch.float32
    assert abs(loss.item() - expected.item()) < 1e-5
    assert tiny(idx)[1] is None


def test_untrained_loss_is_near_log_vocab(tiny):
    # GPT-2 init gives near-uniform predictions: loss ~ ln(65) = 4.17 nats
    _, loss = tiny(torch.randint(0, 65, (8, 32)), torch.randint(0, 65, (8, 32)))
    assert abs(loss.item() - math.log(65)) < 0.1


@pytest.mark.parametrize("t", [0, 5, 17, 30])
def test_causality_future_tokens_never_change_past_logits(t):
    model = randomize(tiny_model())
    idx = torch.randint(0, 65, (2, 32))
    changed = idx.clone()
    changed[:, t + 1 :] = torch.randint(0, 65, changed[:, t + 1 :].shape)
    assert not torch.equal(changed[:, t + 1 :], idx[:, t + 1 :]) or t == 31
    a, b = model(idx)[0], model(changed)[0]
    assert torch.allclose(a[:, : t + 1], b[:, : t + 1], atol=1e-6, rtol=0)
    # the explicit path too
    a, b = forward_with_attention(model, idx)[0], forward_with_attention(model, changed)[0]
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])


def test_fast_and_explicit_attention_paths_agree():
    model = randomize(tiny_model(), seed=1)
    idx = torch.randint(0, 65, (4, 32))
    fast, _ = model(idx)
    explicit, att = forward_with_attention(model, idx)
    assert torch.allclose(fast, explicit, atol=1e-5, rtol=1e-5)
    q, k, v = torch.randn(3, 2, 4, 9, 16).unbind(0)
    y, _ = causal_attention(q, k, v)
    assert torch.allclose(
        y, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("n_layers,n_heads", [(3, 2), (2, 3)])
def test_attention_maps_shape_rows_and_mask(n_layers, n_heads):
    torch.manual_seed(0)
    model = DecoderLM(
        ModelConfig(
            vocab_size=11, block_size=8, n_layers=n_layers, n_heads=n_heads, d_model=4 * n_heads
        )
    )
    randomize(model)
    _, att = forward_with_attention(model, torch.randint(0, 11, (1, 5)))
    assert att.shape == (n_layers, 1, n_heads, 5, 5)
    assert torch.allclose(att.sum(-1), torch.ones(n_layers, 1, n_heads, 5), atol=1e-6)
    assert torch.all(att.triu(1) == 0)
    assert torch.all(att[..., torch.ones(5, 5, dtype=torch.bool).tril()] > 0)


def test_future_positions_get_exactly_zero_weight_with_large_negative_scores():
    # the causal mask must beat legitimate scores near -2e4 (a fixed mask constant such as
    # -1e4 would not): changing the future keys and values leaves the past bitwise unchanged
    torch.manual_seed(0)
    T, D = 6, 16
    q = torch.full((1, 1, T, D), 1.0)
    k = torch.full((1, 1, T, D), -5000.0) + torch.randn(1, 1, T, D)
    v = torch.randn(1, 1, T, D)
    k2, v2 = k.clone(), v.clone()
    k2[..., 3:, :] = torch.randn(1, 1, T - 3, D) * 1e4
    v2[..., 3:, :] = torch.randn(1, 1, T - 3, D) * 1e4
    for attend in (
        lambda *a: causal_attention(*a)[0],
        lambda *a: F.scaled_dot_product_attention(*a, is_causal=True),
    ):
        assert torch.equal(attend(q, k, v)[..., :3, :], attend(q, k2, v2)[..., :3, :])


def test_explicit_attention_is_finite_in_float16_with_large_dot_products():
    # raw q.k = 102,400 exceeds float16's maximum (65,504): the scores must be scaled before
    # the matmul or computed in float32
    q = torch.full((1, 1, 8, 64), 40.0, dtype=torch.float16)
    k = torch.full((1, 1, 8, 64), 40.0, dtype=torch.float16)
    v = torch.randn(1, 1, 8, 64).half()
    y, att = causal_attention(q, k, v)
    ref, _ = causal_attention(q.float(), k.float(), v.float())
    assert torch.isfinite(y).all() and torch.isfinite(att).all()
    assert (y.float() - ref).abs().max() < 1e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.bfloat16, 0.1)])
def test_low_precision_forward_is_finite_and_close(dtype, tol):
    # the mask and softmax must not overflow into inf/NaN in float16 or bfloat16, and the
    # logits stay close to float32's
    model = tiny_model()
    idx = torch.randint(0, 65, (2, 32))
    ref, _ = model(idx)
    try:
        low, loss = model.to(dtype)(idx, idx)
    except RuntimeError as e:  # an op without a CPU kernel for this dtype
        pytest.skip(f"{dtype} not supported on this CPU build: {e}")
    assert torch.isfinite(low).all() and torch.isfinite(loss)
    assert (low.float() - ref).abs().max() < tol


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_embeddings": False}, {"bias": False}, {"n_layers": 3, "n_heads": 2, "d_model": 24}],
)
def test_numpy_reference_gives_the_same_logits(overrides):
    model = randomize(tiny_model(**overrides), seed=3)
    with torch.no_grad():  # keep activations in a range where GELU's curvature matters
        for p in model.parameters():
            p.mul_(0.5)
    idx = torch.randint(0, 65, (2, 32))
    logits, _ = model(idx)
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        params.pop("lm_head.weight")  # the reference must handle tying on its own
    expected = reference.forward(params, model.config, idx.numpy())
    assert np.abs(logits.detach().numpy() - expected).max() < 1e-4
    assert np.abs(expected).max() > 0.5  # the comparison is not between near-zero numbers


# the tiny model's parameter counts, worked out by hand: tied 4,160 + 2,048 + 2 x 49,984 +
# the final LayerNorm's 128; an untied head adds 65 x 64; without bias 104,832
TINY_COUNTS = [({}, 106_304), ({"tie_embeddings": False}, 110_464), ({"bias": False}, 104_832)]


@pytest.mark.parametrize("overrides,expected", TINY_COUNTS)
def test_parameter_count_of_tiny_tied_untied_and_without_bias(overrides, expected):
    model = tiny_model(**overrides)
    assert model.num_parameters() == expected
    assert count_parameters(model.config)["total"] == expected


def test_non_embedding_count_and_tied_matrix_counted_once(tiny):
    assert tiny.num_parameters(non_embedding=True) == 104_256
    assert count_parameters(tiny.config)["non_embedding"] == 104_256
    state_dict_sum = sum(v.numel() for v in tiny.state_dict().values())
    assert state_dict_sum == 110_464 != tiny.num_parameters()


@pytest.mark.parametrize(
    "vocab,block,layers,heads,width,d_ff,bias,tied",
    [
        (65, 32, 2, 4, 64, None, True, True),
        (50257, 1024, 12, 12, 768, None, True, True),  # GPT-2 small: 124,439,808
        (138, 96, 3, 4, 128, None, True, False),
        (1000, 64, 5, 2, 48, 100, False, False),
        (7, 3, 1, 1, 2, 3, False, True),
    ],
)
def test_closed_form_parameter_count_equals_the_modules(
    vocab, block, layers, heads, width, d_ff, bias, tied
):
    cfg = ModelConfig(
        vocab_size=vocab,
        block_size=block,
        n_layers=layers,
        n_heads=heads,
        d_model=width,
        d_ff=d_ff,
        bias=bias,
        tie_embeddings=tied,
    )
    with torch.device("meta"):
        model = DecoderLM(cfg)
    counts = count_parameters(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    parts = ("embeddings", "attention", "mlp", "norms", "head")
    assert sum(counts[k] for k in parts) == counts["total"]
    if (vocab, layers, width) == (50257, 12, 768):
        assert counts["total"] == 124_439_808


def test_gpt2_initialisation_statistics():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=500, block_size=64, n_layers=8, n_heads=4, d_model=256)
    model = DecoderLM(cfg)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    for name, p in model.named_parameters():
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            assert abs(p.std().item() / residual_std - 1) < 0.05, name
        elif name.endswith("weight") and p.dim() == 2:
            assert abs(p.std().item() / 0.02 - 1) < 0.05, name
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
    assert model.lm_head.weight is model.tok_emb.weight
    untied = DecoderLM(ModelConfig(**{**cfg.to_dict(), "tie_embeddings": False}))
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_model_can_memorise_one_batch():
    torch.manual_seed(0)
    model = DecoderLM(tiny_config()).train()
    x = torch.randint(0, 65, (4, 32))
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


@pytest.mark.parametrize(
    "field,kwargs,match",
    [
        (
            "n_heads",
            dict(d_model=64, n_heads=5),
            r"d_model \(64\) must be divisible by n_heads \(5\)",
        ),
        ("n_layers", dict(n_layers=0), "n_layers must be a positive integer"),
        ("d_model", dict(d_model=-8), "d_model must be a positive integer"),
        ("vocab_size", dict(vocab_size=2.5), "vocab_size must be a positive integer"),
        ("dropout", dict(dropout=1.0), r"dropout must be a finite number in \[0.0, 1.0\)"),
        ("dropout", dict(dropout=float("nan")), "dropout must be a finite number"),
        ("dropout", dict(dropout=None), "dropout must be a finite number"),
        ("bias", dict(bias="yes"), "bias must be true or false"),
        (
            "max_positions",
            {"block_size": 16, "max_positions": 48},
            r"max_positions \(48\) > block_size \(16\) needs pos_encoding 'sinusoidal' or 'rope'",
        ),
        (
            "max_positions",
            {"block_size": 16, "max_positions": 8, "pos_encoding": "rope"},
            r"max_positions \(8\) must be >= block_size \(16\)",
        ),
        (
            "max_positions",
            {"max_positions": 40.0, "pos_encoding": "rope"},
            "max_positions must be a positive integer",
        ),
    ],
)
def test_config_validation_names_the_field(field, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**kwargs)


def test_unknown_config_field_is_refused():
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        ModelConfig.from_dict({**tiny_config().to_dict(), "n_layer": 3})


def test_too_long_input_raises_clear_error_naming_block_size():
    # a forward on more tokens than there are positions raises a ValueError naming the
    # limit (block_size, or max_positions where larger), not an embedding index error
    model = tiny_model(block_size=16)
    with pytest.raises(ValueError, match="T=17 exceeds block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    longer = tiny_model(block_size=16, max_positions=48, pos_encoding="sinusoidal")
    assert longer(torch.zeros(1, 48, dtype=torch.long))[0].shape == (1, 48, 65)
    with pytest.raises(ValueError, match="T=49 exceeds max_positions=48"):
        longer(torch.zeros(1, 49, dtype=torch.long))


@pytest.mark.parametrize("pos", ["sinusoidal", "rope"])
def test_positions_past_block_size_match_the_numpy_reference(pos):
    # the tables past block_size (up to max_positions) against the reference's formulas
    model = halved_random_model(4, block_size=16, max_positions=48, pos_encoding=pos)
    assert_matches_reference(model, torch.randint(0, 65, (1, 48)))


def test_out_of_vocabulary_ids_and_bad_dtypes_raise_value_error(tiny):
    with pytest.raises(ValueError, match=r"\[0, vocab_size=65\)"):
        tiny(torch.tensor([[1, 65]]))
    with pytest.raises(ValueError, match="int64"):
        tiny(torch.zeros(1, 4))


def test_dropout_is_off_in_eval_mode():
    # dropout must be off in eval mode: the same logits twice, and the same loss as a copy
    # built with dropout 0.0
    model = tiny_model(dropout=0.2)
    idx = torch.randint(0, 65, (2, 32))
    assert torch.equal(model(idx)[0], model(idx)[0])
    no_dropout = DecoderLM(tiny_config(dropout=0.0)).eval()
    no_dropout.load_state_dict(model.state_dict())
    assert torch.equal(model(idx, idx)[1], no_dropout(idx, idx)[1])
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])  # and on in train mode


def test_eval_mode_turns_dropout_off_and_gives_the_mode_back_even_after_an_error():
    # inside the block every module is in eval mode (same logits twice); after it, and after
    # an error raised in it, the model is back in train mode, dropout on again
    model = tiny_model(dropout=0.3).train()
    idx = torch.randint(0, 65, (1, 16))
    with eval_mode(model) as same:
        assert same is model and not any(m.training for m in model.modules())
        assert torch.equal(model(idx)[0], model(idx)[0])
    assert all(m.training for m in model.modules())
    with pytest.raises(RuntimeError, match="inside"), eval_mode(model):
        raise RuntimeError("inside")
    assert all(m.training for m in model.modules())
    model.eval().blocks[0].train()  # one module left in train mode: all in eval inside
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert not any(m.training for m in model.modules())  # the model's own mode: eval


def test_eval_mode_leaves_a_model_in_eval_mode_untouched(monkeypatch):
    # a model already in eval mode throughout is not walked by nn.Module.train/eval again
    # (that walk sets every submodule, and decoding enters eval_mode at every request)
    model = tiny_model().eval()
    calls = []
    monkeypatch.setattr(torch.nn.Module, "train", lambda self, mode=True: calls.append(mode))
    with eval_mode(model):
        pass
    assert calls == []
    model.blocks[0].training = True
    with eval_mode(model):
        pass
    assert calls == [False, False]  # eval() on entry, train(False) on exit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_training_attention_path_matches_the_fused_kernel(dtype):
    # attn.impl "explicit" (chosen for CPU training with a short context in bfloat16, or with
    # dropout on the probabilities) must give what the fused kernel gives, in the forward pass
    # and in the gradients (no dropout here, so both are deterministic)
    model = randomize(DecoderLM(tiny_config()), seed=3).train()
    idx = torch.randint(0, 65, (2, 32))
    results = {}
    for impl in ("sdpa", "explicit"):
        for block in model.blocks:
            block.attn.impl = impl
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits, loss = model(idx, idx)
        loss.backward()
        results[impl] = (logits.float(), model.tok_emb.weight.grad.clone())
    tol = {"atol": 0.1, "rtol": 0.05} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-4}
    torch.testing.assert_close(results["explicit"][0], results["sdpa"][0], **tol)
    grad_tol = {"atol": 0.02, "rtol": 0.1} if dtype == torch.bfloat16 else tol
    torch.testing.assert_close(results["explicit"][1], results["sdpa"][1], **grad_tol)
