"""Table sizes of the model (decoderlm.model.model): a padded vocabulary and a cropped context."""

import numpy as np
import pytest
import torch

from decoderlm import DecoderLM
from decoderlm.errors import UserError
from decoderlm.evaluate import evaluate
from decoderlm.generation.generate import generate
from decoderlm.model import reference
from decoderlm.model.analysis import count_parameters
from decoderlm.model.hooks import run_with_cache

from conftest import assert_matches_reference, randomize, tiny_config, tiny_model

IDX = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(3))


def padded_copy(model: DecoderLM, rows: int, pad_value: float) -> DecoderLM:
    """model with its vocabulary padded to `rows` rows filled with pad_value (so large that a
    padded id would win every sample if its logit were kept)."""
    cfg = model.config
    padded = DecoderLM(tiny_config(**{**cfg.to_dict(), "padded_vocab_size": rows})).eval()
    state = dict(model.state_dict())
    for key in ("tok_emb.weight", "lm_head.weight"):
        extra = torch.full((rows - cfg.vocab_size, cfg.d_model), pad_value)
        state[key] = torch.cat([state[key], extra])
    padded.load_state_dict(state)
    return padded


@pytest.mark.parametrize("tied", [True, False])
def test_padded_rows_never_reach_the_logits_the_loss_or_sampling(tied):
    plain = randomize(tiny_model(tie_embeddings=tied), seed=1)
    padded = padded_copy(plain, 128, pad_value=5.0)
    assert padded.tok_emb.weight.shape == padded.lm_head.weight.shape == (128, 64)
    targets = torch.roll(IDX, -1, 1)
    logits, loss = padded(IDX, targets)
    assert logits.shape == (2, 32, 65)
    assert_matches_reference(padded, IDX)  # the NumPy forward, which drops rows past 65
    (_, _), cache = run_with_cache(padded, IDX, ["unembed.hook_in", "unembed.hook_out"])
    assert torch.equal(padded.to_logits(cache["unembed.hook_in"]), logits)  # e.g. a logit lens
    assert cache["unembed.hook_out"].shape == (2, 32, 65)
    with pytest.raises(UserError, match="to_logits"):  # model.unembed only names hook points
        padded.unembed(cache["unembed.hook_in"])
    plain_logits, plain_loss = plain(IDX, targets)
    torch.testing.assert_close(logits, plain_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, plain_loss, atol=1e-6, rtol=0)
    # sampling (KV-cached decoding) and greedy decoding never produce a padded id although
    # the padded rows would dominate the softmax if they had logits
    sampled = generate(padded, IDX[:, :4], 60, temperature=2.0, seed=0)
    assert int(sampled.max()) < 65
    assert torch.equal(
        generate(padded, IDX[:, :4], 20, temperature=0.0),
        generate(plain, IDX[:, :4], 20, temperature=0.0),
    )
    assert evaluate(padded, IDX.flatten()) == pytest.approx(evaluate(plain, IDX.flatten()))
    with pytest.raises(ValueError, match=r"\[0, vocab_size=65\)"):
        padded(torch.tensor([[70]]))  # a padded row is not a token
    # training never moves the padded rows: they get no gradient
    padded.train()
    padded(IDX, targets)[1].backward()
    for weight in (padded.tok_emb.weight, padded.lm_head.weight):
        assert weight.grad[65:].abs().max() == 0 and weight.grad[:65].abs().max() > 0


def test_padded_parameter_counts():
    # the padded embedding rows are parameters: tied, they count once (the tiny model's
    # 106,304 plus the padding); untied, once in the embedding and once in the head
    pad = (128 - 65) * 64
    for tied, expected in ((True, 106_304 + pad), (False, 110_464 + 2 * pad)):
        cfg = tiny_config(padded_vocab_size=128, tie_embeddings=tied)
        assert DecoderLM(cfg).num_parameters() == count_parameters(cfg)["total"] == expected
    assert tiny_config(padded_vocab_size=65).vocab_rows == 65
    with pytest.raises(ValueError, match=r"padded_vocab_size \(64\) must be >= vocab_size"):
        tiny_config(padded_vocab_size=64)


def test_a_padded_model_saves_and_loads(tmp_path):
    model = padded_copy(randomize(tiny_model(), seed=2), 96, pad_value=0.0)
    model.save_pretrained(tmp_path)
    again = DecoderLM.from_pretrained(tmp_path)
    assert again.config.padded_vocab_size == 96 and again.tok_emb.weight.shape == (96, 64)
    assert torch.equal(again(IDX)[0], model(IDX)[0])


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"pos_encoding": "sinusoidal"},
        {"pos_encoding": "rope"},
        {"pos_encoding": "rope", "block_size": 16, "max_positions": 48},
    ],
)
def test_cropping_keeps_the_logits_of_short_inputs(options):
    full = randomize(tiny_model(**options), seed=4)
    with torch.no_grad():
        for p in full.parameters():
            p.mul_(0.5)
    long_logits = full(IDX[:, : full.config.max_positions])[0]
    short_logits = full(IDX[:, :5])[0]
    cropped = full.crop_block_size(8)
    assert cropped is full and cropped.config.block_size == cropped.config.max_positions == 8
    for name in ("pos_table", "rope_cos", "rope_sin"):
        if hasattr(cropped, name):
            assert getattr(cropped, name).size(0) == 8
    if cropped.pos_emb is not None:
        assert cropped.pos_emb.weight.shape == (8, 64) and cropped.pos_emb.weight.requires_grad
    torch.testing.assert_close(cropped(IDX[:, :8])[0], long_logits[:, :8], atol=1e-5, rtol=0)
    torch.testing.assert_close(cropped(IDX[:, :5])[0], short_logits, atol=1e-5, rtol=0)
    params = {k: v.numpy() for k, v in cropped.state_dict().items()}
    expected = reference.forward(params, cropped.config, IDX[:, :8].numpy())
    assert np.abs(cropped(IDX[:, :8])[0].detach().numpy() - expected).max() < 1e-4
    with pytest.raises(ValueError, match="block_size=8"):
        cropped(IDX[:, :9])


def test_a_cropped_model_generates_past_its_context_and_saves(tmp_path):
    # a model cropped from block_size 32 to 16 crops the sampling context to 16 tokens too,
    # refuses a 17-token forward by naming block_size, and saves its new size
    model = tiny_model().crop_block_size(16)
    seen = []
    model.tok_emb.register_forward_pre_hook(lambda m, args: seen.append(args[0].size(1)))
    out = generate(model, torch.zeros(1, 1, dtype=torch.long), 200, seed=0)
    assert out.shape == (1, 201) and max(seen) <= 16
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    model.save_pretrained(tmp_path)
    again = DecoderLM.from_pretrained(tmp_path)
    assert again.config.block_size == 16 and torch.equal(
        again(IDX[:, :16])[0], model(IDX[:, :16])[0]
    )


@pytest.mark.parametrize("size", [33, 0, -1, True, 8.0, "8"])
def test_cropping_to_more_than_block_size_or_not_a_size_is_refused(size):
    model = tiny_model()
    with pytest.raises(ValueError, match=r"block_size=32; give an integer from 1 to 32"):
        model.crop_block_size(size)
    assert model.config.block_size == 32 and model.pos_emb.weight.size(0) == 32
