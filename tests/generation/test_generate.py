import pytest
import torch

from decoderlm.generation.generate import filter_logits, generate, sample_next, stream_generate
from decoderlm.generation.params import SamplingParams

from conftest import randomize, tiny_model

FOUR = torch.tensor([[0.1, 3.0, 0.2, 2.9]])  # softmax ~ [0.027, 0.495, 0.030, 0.448]


# forward passes: the prompt's, then one per new token (a slide's rebuild is that token's pass)
@pytest.mark.parametrize("pos_prompt,new,passes", [(1, 200, 200), (40, 10, 10)])
def test_generation_past_block_size_crops_the_context(pos_prompt, new, passes):
    # learned positions index a table of block_size rows: a prompt plus new tokens longer than
    # that must be cropped to the last 16 tokens before every call, not crash in the lookup
    model = tiny_model(block_size=16)
    seen, positions = [], []
    model.tok_emb.register_forward_pre_hook(lambda m, args: seen.append(args[0].size(1)))
    model.pos_emb.register_forward_pre_hook(lambda m, args: positions.append(int(args[0].max())))
    out = generate(model, torch.zeros(1, pos_prompt, dtype=torch.long), new, seed=0)
    assert out.shape == (1, pos_prompt + new)
    assert len(seen) == passes and max(seen) <= 16 and max(positions) == 15


@pytest.mark.parametrize("slide_by", [1, 5, 16])
def test_slide_by_drops_that_many_tokens_when_the_context_is_full(slide_by):
    """Greedy tokens with slide_by=k are those of rerunning the whole model on a window that
    keeps growing to block_size tokens and then restarts from the last block_size + 1 - k."""
    model = randomize(tiny_model(block_size=16)).double()  # tokens that depend on the context
    prompt = torch.randint(0, 65, (1, 3), generator=torch.Generator().manual_seed(0))
    out = generate(model, prompt, 40, do_sample=False, slide_by=slide_by)
    ids, start = prompt[0].tolist(), 0
    with torch.no_grad():
        while len(ids) < 43:
            if len(ids) - start > 16:
                start = len(ids) - (17 - slide_by)
            logits, _ = model(torch.tensor([ids[start:]]))
            ids.append(int(logits[0, -1].argmax()))
    assert out[0].tolist() == ids
    for bad in (0, 17, 1.5):
        with pytest.raises(ValueError, match="slide_by must be an integer in"):
            generate(model, prompt, 2, slide_by=bad)


@pytest.mark.parametrize("top_p", [0.0, 1e-9, 0.3])
@pytest.mark.parametrize("top_k", [None, 2])
def test_tiny_top_p_keeps_the_most_likely_token(top_p, top_k):
    # a nucleus smaller than the top probability (or top_p = 0) must still keep the argmax,
    # never fall back to token 0 or leave multinomial with all-zero weights
    for seed in range(100):
        g = torch.Generator().manual_seed(seed)
        assert sample_next(FOUR, SamplingParams(top_k=top_k, top_p=top_p), g).item() == 1
    kept = torch.isfinite(filter_logits(FOUR, top_k, top_p))
    assert kept.tolist() == [[False, True, False, False]]


def test_top_p_and_top_k_keep_the_right_sets():
    assert torch.isfinite(filter_logits(FOUR, top_p=0.6)).tolist() == [[False, True, False, True]]
    assert torch.isfinite(filter_logits(FOUR, top_k=3)).tolist() == [[False, True, True, True]]
    assert torch.isfinite(filter_logits(FOUR, top_p=1.0)).all()


def test_temperature_zero_is_greedy_and_negative_is_refused():
    # temperature 0 means greedy (no division by zero, the same ids for every seed), a tiny
    # temperature gives the same ids without overflow, and a negative one is refused
    logits = torch.zeros(1, 10)
    logits[0, 7] = 2.0
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        assert sample_next(logits, SamplingParams(temperature=0.0), g).item() == 7
        greedy_filtered = SamplingParams(temperature=0.0, top_k=5, top_p=0.9)
        assert sample_next(logits, greedy_filtered, g).item() == 7
        assert sample_next(logits, SamplingParams(temperature=1e-8), g).item() == 7
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=float("nan"))
    model = tiny_model()
    prompt = torch.tensor([[3, 1, 4]])
    greedy = [generate(model, prompt, 20, temperature=0.0, seed=s) for s in range(3)]
    assert all(torch.equal(greedy[0], g) for g in greedy)
    assert torch.equal(greedy[0], generate(model, prompt, 20, do_sample=False))
    assert torch.equal(greedy[0], generate(model, prompt, 20, temperature=1e-8, seed=5))
    # greedy really is the argmax of the full forward at every step
    seq = prompt
    for _ in range(20):
        seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(seq, greedy[0])


def test_sampling_draws_from_the_softmax():
    # chi-square goodness of fit, df = 3; 16.27 is the 0.999 quantile
    logits = torch.tensor([[0.5, -1.0, 1.5, 0.0]])
    probs = logits.softmax(-1)[0]
    g = torch.Generator().manual_seed(123)
    n = 20_000
    draws = torch.stack(
        [sample_next(logits.expand(100, 4), SamplingParams(), g) for _ in range(n // 100)]
    ).flatten()
    counts = torch.bincount(draws, minlength=4).double()
    chi2 = ((counts - n * probs) ** 2 / (n * probs)).sum().item()
    assert chi2 < 16.27


def test_same_seed_same_text_and_bad_controls():
    model = tiny_model()
    prompt = torch.tensor([[5, 6]])
    a = generate(model, prompt, 30, seed=7, top_k=10)
    assert torch.equal(a, generate(model, prompt, 30, seed=7, top_k=10))
    assert not torch.equal(a, generate(model, prompt, 30, seed=8, top_k=10))
    with pytest.raises(ValueError, match="top_k"):
        generate(model, prompt, 3, top_k=0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompt, 3, top_p=1.5)
    with pytest.raises(ValueError, match="T >= 1"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)


def test_generate_in_train_mode_is_deterministic_and_restores_the_mode():
    # dropout must not reach sampling: greedy ids are the same twice from a model left in
    # train mode, and the model is back in train mode afterwards
    model = tiny_model(dropout=0.3).train()
    prompt = torch.tensor([[1, 2, 3]])
    a = generate(model, prompt, 15, do_sample=False)
    b = generate(model, prompt, 15, do_sample=False)
    assert torch.equal(a, b) and model.training


def test_non_finite_logits_and_bad_ids_name_the_step(monkeypatch):
    # an out-of-range id from the sampler, or NaN logits, must raise an error naming the step
    # (and the id, or the non-finite logits) instead of reaching decode
    model = tiny_model()
    calls = {"n": 0}
    original = model.forward_cached

    def nan_at_step_3(*args, **kwargs):
        logits = original(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 4:
            logits = logits.clone()
            logits[0, -1, 5] = float("nan")
        return logits

    monkeypatch.setattr(model, "forward_cached", nan_at_step_3)
    with pytest.raises(ValueError, match=r"step 3: .*non-finite logits"):
        generate(model, torch.tensor([[1]]), 10, seed=0)
    monkeypatch.undo()
    monkeypatch.setattr(
        torch,
        "multinomial",
        lambda probs, n, generator=None: torch.full((probs.size(0), 1), -(2**63)),
    )
    with pytest.raises(ValueError, match=r"step 0: sampled token id \[-9223372036854775808\]"):
        generate(model, torch.tensor([[1]]), 10, seed=0)


def test_the_pad_id_never_becomes_text():
    # generate() pads stopped rows with pad_token_id (-1 by default); decoding such a row must
    # fail loudly, not index the vocabulary from its end (Python's chars[-1])
    from decoderlm import CharTokenizer, GPT2Tokenizer
    from decoderlm.generation.generate import stream_text

    model = tiny_model()
    chars = CharTokenizer([chr(c) for c in range(48, 48 + 65)])
    prompt = torch.tensor([[1, 2], [3, 4]])
    free = generate(model, prompt, 10, do_sample=False)
    padded = generate(model, prompt, 10, do_sample=False, stop=[int(free[0, 2])])
    assert (padded[0, 3:] == -1).all() and (padded[1] == free[1]).all()
    for tok in (chars, GPT2Tokenizer()):
        with pytest.raises(ValueError, match=r"\[-1, -1.*are outside"):
            tok.decode(padded[0])
    # the text API decodes one row that never stops by token id, so no pad is ever decoded
    pieces = list(stream_text(model, chars, [1, 2], SamplingParams(10, temperature=0)))
    assert "".join(p[0] for p in pieces) == chars.decode(free[0, 2:])


def test_streaming_yields_the_same_tokens_as_generate():
    model = tiny_model()
    prompt = torch.randint(0, 65, (2, 4))
    streamed = torch.stack(
        list(stream_generate(model, prompt, SamplingParams(12, seed=9, top_k=7))), dim=1
    )
    assert torch.equal(
        torch.cat([prompt, streamed], 1), generate(model, prompt, 12, seed=9, top_k=7)
    )


def test_stop_token_ids_end_rows_early():
    model = tiny_model()
    prompt = torch.randint(0, 65, (2, 3))
    free = generate(model, prompt, 30, do_sample=False)
    first = free[0, 3 + 4].item()  # stop at row 0's 5th new token
    out = generate(model, prompt, 30, do_sample=False, stop=[first], pad_token_id=-7)
    row0 = out[0, 3:].tolist()
    k = row0.index(first)
    assert row0[: k + 1] == free[0, 3 : 3 + k + 1].tolist()
    assert all(t == -7 for t in row0[k + 1 :])
    stop_pair = free[1, 3 + 5 : 3 + 7].tolist()
    single = generate(model, prompt[1:], 30, do_sample=False, stop=[stop_pair])
    assert single[0, -2:].tolist() == stop_pair and single.size(1) <= 3 + 7
    with pytest.raises(ValueError, match="stop must hold token ids"):
        generate(model, prompt, 3, stop=[[]])


def test_stop_accepts_tensors_and_numpy_integers():
    import numpy as np

    model = tiny_model()
    prompt = torch.randint(0, 65, (1, 3))
    first = generate(model, prompt, 1, do_sample=False)[0, -1].item()
    for stop in (torch.tensor([first]), [np.int64(first)], [torch.tensor(first)]):
        assert generate(model, prompt, 10, do_sample=False, stop=stop).size(1) == 4
