"""The lens: logit lens, surprisal, head scores, patching and embedding maps, checked on
hand-built models whose heads do known things, and against closed forms."""

import math

import pytest
import torch
import torch.nn.functional as F

from decoderlm import ByteTokenizer, CharTokenizer, DecoderLM, GPT2Tokenizer, ModelConfig
from decoderlm.lens.lens import (
    detection_patterns,
    embedding_map,
    head_scores,
    logit_lens,
    patch_heads,
    patch_resid_pre,
    pca_2d,
    probe_metrics,
    repeated_probe,
    surprisal,
    token_byte_counts,
    unembed,
)
from decoderlm.model.hooks import run_with_cache

from conftest import halved_random_model

V, T = 8, 16  # vocabulary and context of the hand-built model


def induction_model(layer1: bool = True) -> DecoderLM:
    """A 2-layer attention-only model (MLPs zero) with hand-set weights.

    The residual stream has three one-hot blocks: token (dims 0..7), position (8..23) and
    "previous token" (24..31). Layer 0, head 0 is a previous-token head: the query of
    position t is the one-hot of t - 1, keys are positions, values the token one-hot, written
    into the previous-token block. Layer 1, head 0 is an induction head: the query is the
    current token, keys are the previous-token block, so position t attends to s where
    token[s - 1] == token[t]. Head 1 of each layer is zero (uniform attention, no output).
    lm_head reads the previous-token block: the model predicts the token before the current.
    """
    config = ModelConfig(
        vocab_size=V,
        block_size=T,
        n_layers=2,
        n_heads=2,
        d_model=2 * V + T,
        norm="rmsnorm",
        bias=False,
        tie_embeddings=False,
    )
    model = DecoderLM(config).eval()
    tok, pos, prev = range(0, V), range(V, V + T), range(V + T, 2 * V + T)
    hd, d = config.head_dim, config.d_model
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for p in (model.ln_f.weight, *(b.ln_1.weight for b in model.blocks)):
            p.fill_(1.0)
        model.tok_emb.weight[:, :V] = torch.eye(V)
        model.pos_emb.weight[:, V : V + T] = torch.eye(T)
        qkv0 = model.blocks[0].attn.qkv.weight  # rows: q (0..d), k (d..2d), v (2d..3d)
        for t in range(1, T):
            qkv0[t - 1, pos[t]] = 5.0  # q of position t: one-hot of t - 1
        for s in range(T):
            qkv0[d + s, pos[s]] = 1.0  # k of position s: one-hot of s
        for i in range(V):
            qkv0[2 * d + i, tok[i]] = 1.0  # v: the token
            model.blocks[0].attn.proj.weight[prev[i], i] = 1.0  # head 0 -> previous block
        if layer1:
            qkv1 = model.blocks[1].attn.qkv.weight
            for i in range(V):
                qkv1[i, tok[i]] = 5.0  # q: the current token
                qkv1[d + i, prev[i]] = 1.0  # k: the previous token
                qkv1[2 * d + i, tok[i]] = 1.0
                model.blocks[1].attn.proj.weight[tok[i], i] = 1.0
        model.lm_head.weight[:, prev[0] : prev[-1] + 1] = torch.eye(V)
    assert hd == T  # the positions fit a head
    return model


def test_the_hand_built_induction_head_ranks_first_and_the_previous_token_head_too():
    model = induction_model()
    probe = repeated_probe(V, T // 2, batch=8, seed=1)
    scores = head_scores(model, probe)
    assert all(s.shape == (2, 2) for s in scores.values())
    induction, previous = scores["induction"], scores["previous_token"]
    assert induction.flatten().argmax() == 2 and induction[1, 0] > 0.8  # layer 1, head 0
    assert previous.flatten().argmax() == 0 and previous[0, 0] > 0.95  # layer 0, head 0
    assert induction[1, 0] > 2 * induction.flatten()[[0, 1, 3]].max()
    # on the probe's second half every token is an earlier copy: the induction head's keys
    # s = t - S + 1 are each one after a duplicate of t, so it is no duplicate-token head
    assert scores["duplicate_token"][1, 0] < 0.2
    metrics = probe_metrics(model.train(), probe)
    assert model.training  # its mode is given back
    assert metrics["induction_score"][1] == pytest.approx(float(induction[1, 0]), abs=1e-4)
    assert math.isfinite(metrics["probe_second_half_loss"])


def test_detection_patterns_on_a_small_sequence():
    idx = torch.tensor([[3, 5, 3, 5]])
    p = {k: v[0].int().tolist() for k, v in detection_patterns(idx).items()}
    assert p["previous_token"] == [[0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]
    assert p["duplicate_token"] == [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]]
    # query 2 (token 3): the token after the earlier 3 is at 1; query 3 (5): after the 5 at 1
    assert p["induction"] == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]


def test_repeated_probe_repeats_ids_of_the_vocabulary():
    probe = repeated_probe(65, 10, batch=3, seed=0)
    assert probe.shape == (3, 20) and probe.min() >= 0 and probe.max() < 65
    assert torch.equal(probe[:, :10], probe[:, 10:])
    assert torch.equal(probe, repeated_probe(65, 10, batch=3, seed=0))


def test_patching_finds_the_one_position_and_head_that_carry_the_answer():
    # the model predicts the token before the last one, moved by layer 0 head 0; layer 1 is
    # zero. Clean and corrupted prompts differ only at position T - 2.
    model = induction_model(layer1=False)
    clean = torch.tensor([1, 2, 3, 4, 5, 6])
    corrupted = torch.tensor([1, 2, 3, 4, 7, 6])
    resid = patch_resid_pre(model, clean, corrupted, answer=5, wrong=7)
    expected = torch.zeros(2, 6)
    expected[0, 4] = 1.0  # the token itself, before layer 0 moves it
    expected[1, 5] = 1.0  # after layer 0 it sits at the last position
    torch.testing.assert_close(resid, expected, atol=1e-4, rtol=0)
    heads = patch_heads(model, clean, corrupted, answer=5, wrong=7)
    torch.testing.assert_close(heads, torch.tensor([[1.0, 0.0], [0.0, 0.0]]), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="equal length"):
        patch_resid_pre(model, clean, corrupted[:-1], 5, 7)
    with pytest.raises(ValueError, match="same logit difference"):
        patch_heads(model, clean, clean, 5, 7)


@pytest.mark.parametrize("combo", [{}, dict(norm_position="post", pos_encoding="rope")])
def test_the_logit_lens_last_row_is_the_models_output(combo):
    model = halved_random_model(3, **combo)
    ids = torch.randint(0, 65, (12,))
    with torch.no_grad():
        logits = model(ids[None])[0][0]
    lens = logit_lens(model, ids, k=4)
    L = model.config.n_layers
    assert lens["top_ids"].shape == (L + 1, 12, 4) and lens["next_prob"].shape == (L + 1, 11)
    probs, top = logits.softmax(-1).topk(4)
    assert torch.equal(lens["top_ids"][-1], top)
    torch.testing.assert_close(lens["top_probs"][-1], probs)
    torch.testing.assert_close(
        lens["next_prob"][-1],
        probs.new_tensor([logits.softmax(-1)[t, ids[t + 1]] for t in range(11)]),
    )
    _, cache = run_with_cache(model, ids[None], ["blocks.0.hook_resid_pre", "hook_resid_post"])
    assert torch.equal(unembed(model, cache[f"blocks.{L - 1}.hook_resid_post"])[0], logits)
    first = unembed(model, cache["blocks.0.hook_resid_pre"])[0].softmax(-1).topk(4)
    assert torch.equal(lens["top_ids"][0], first.indices)


def test_surprisal_is_the_models_cross_entropy_in_bits():
    model = halved_random_model(4)
    ids = torch.randint(0, 65, (15,))
    s = surprisal(model, ids, k=3)
    _, loss = model(ids[None, :-1], ids[None, 1:])
    assert float(s["bits_per_token"]) == pytest.approx(loss.item() / math.log(2), rel=1e-5)
    logits = model(ids[None])[0][0, :-1]
    order = logits.argsort(-1, descending=True)
    ranks = [int((order[t] == ids[t + 1]).nonzero()) for t in range(14)]
    assert s["rank"].tolist() == ranks
    assert torch.equal(s["top_ids"], order[:, :3])
    with pytest.raises(ValueError, match="at least 2"):
        surprisal(model, ids[:1])


def test_bits_per_byte_counts_the_utf8_bytes_of_each_token():
    text = "héllo wörld"
    char = CharTokenizer.from_text(text)
    assert token_byte_counts(char, char.encode(text)) == [1, 2, 1, 1, 1, 1, 1, 2, 1, 1, 1]
    byte = ByteTokenizer()
    assert token_byte_counts(byte, byte.encode(text)) == [1] * 13
    gpt2 = GPT2Tokenizer()
    assert sum(token_byte_counts(gpt2, gpt2.encode(text))) == len(text.encode())
    model = halved_random_model(5, vocab_size=256)
    ids = torch.tensor(byte.encode(text))
    s = surprisal(model, ids, token_bytes=token_byte_counts(byte, ids))
    torch.testing.assert_close(s["bits_per_byte"], s["bits_per_token"])  # one byte a token
    ids = torch.tensor(char.encode(text))
    s = surprisal(model, ids, token_bytes=token_byte_counts(char, ids))
    # tokens 1..10 are "éllo wörld": 12 bytes
    assert float(s["bits_per_byte"]) == pytest.approx(float(s["bits"].sum()) / 12)


def test_pca_of_points_in_a_plane_keeps_their_distances():
    g = torch.Generator().manual_seed(0)
    plane, _ = torch.linalg.qr(torch.randn(10, 2, generator=g))  # two orthonormal axes
    coords = torch.randn(30, 2, generator=g) * torch.tensor([3.0, 1.0])
    x = coords @ plane.T + 5.0  # 30 points of a plane in 10-D, off the origin
    xy = pca_2d(x)
    xy64, x64 = xy.double(), x.double()
    torch.testing.assert_close(torch.cdist(xy64, xy64), torch.cdist(x64, x64), atol=1e-4, rtol=0)
    assert xy[:, 0].var() > xy[:, 1].var()  # the first axis is the wider one
    torch.testing.assert_close(xy.mean(0), torch.zeros(2), atol=1e-5, rtol=0)


def test_embedding_map_shapes():
    model = halved_random_model(6)
    m = embedding_map(model, max_tokens=40)
    assert m["tokens"].shape == (40, 2) and m["positions"].shape == (32, 2)
    assert embedding_map(halved_random_model(6, pos_encoding="rope"))["positions"] is None
    assert not torch.isnan(m["tokens"]).any()
    assert F.cosine_similarity(m["tokens"][:, 0], m["tokens"][:, 1], dim=0).abs() < 1e-4
