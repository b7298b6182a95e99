"""Cached decoding against the model itself: the full forward pass at every step."""

import copy
import re

import pytest
import torch

from decoderlm.generation import steps
from decoderlm.generation.generate import generate
from decoderlm.generation.precision import prepare_for_decoding
from decoderlm.model.kv_cache import KVCache, SlotKVCache

from conftest import halved_random_model, randomize, tiny_model


def greedy_by_full_forward(model, prompt, n):
    """The oracle: rerun the model on the last max_positions tokens (block_size unless the
    config allows more) for every new token."""
    seq = prompt
    for _ in range(n):
        logits, _ = model(seq[:, -model.config.max_positions :])
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


@pytest.mark.parametrize(
    "overrides",
    [
        {"pos_encoding": "learned"},
        {"pos_encoding": "sinusoidal"},
        {"pos_encoding": "rope"},
        {
            "pos_encoding": "rope",
            "norm_position": "post",
            "norm": "rmsnorm",
            "mlp": "swiglu",
            "d_ff": 96,
        },
    ],
)
def test_cached_greedy_equals_full_forward_for_200_tokens_past_block_size(overrides):
    model = randomize(tiny_model(block_size=16, **overrides), seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.4)
    prompt = torch.randint(0, 65, (2, 5))
    expected = greedy_by_full_forward(model, prompt, 200)
    assert torch.equal(generate(model, prompt, 200, do_sample=False), expected)
    assert torch.equal(generate(model, prompt, 200, do_sample=False, use_cache=False), expected)


@pytest.mark.parametrize("pos", ["sinusoidal", "rope"])
def test_positions_go_past_block_size_up_to_max_positions_then_slide(pos):
    # block_size 16, max_positions 48, 5-token prompt, 60 new tokens: 65 > 48, so it slides
    model = halved_random_model(5, block_size=16, max_positions=48, pos_encoding=pos)
    calls = []  # (number of new tokens, largest position id) of every cached forward
    forward_cached = model.forward_cached

    def spy(idx, cache, position_ids, *args, **kwargs):
        calls.append((idx.size(1), int(position_ids.max())))
        return forward_cached(idx, cache, position_ids, *args, **kwargs)

    model.forward_cached = spy
    prompt = torch.randint(0, 65, (2, 5))
    out = generate(model, prompt, 60, do_sample=False)
    # the prompt, then one token at a time at positions 5..47 (no rebuild at block_size),
    # then, from 48 tokens on, a rebuild of the last 48 at every step
    assert calls == [(5, 4)] + [(1, p) for p in range(5, 48)] + [(48, 47)] * 16
    assert torch.equal(out, greedy_by_full_forward(model, prompt, 60))
    del model.forward_cached
    assert torch.equal(generate(model, prompt, 60, do_sample=False, use_cache=False), out)


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_per_step_logits_and_positions_match_the_full_forward(pos):
    # cached decoding must place each new token after the tokens already cached (step t of a
    # 5-token prompt is at position 5 + t) and give the full forward's logits at every step
    model = randomize(tiny_model(pos_encoding=pos), seed=2)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.4)
    seq = torch.randint(0, 65, (1, 5))
    cache = KVCache(model.config, 1, "cpu", torch.float32)
    with torch.no_grad():
        logits = model.forward_cached(
            seq, cache, torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool)
        )
        for t in range(20):
            full, _ = model(seq)
            assert torch.allclose(logits[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)
            nxt = full[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            assert cache.length == 5 + t
            logits = model.forward_cached(
                nxt, cache, torch.tensor([[5 + t]]), torch.ones(1, 6 + t, dtype=torch.bool)
            )


def test_a_request_longer_than_the_cache_rolls_instead_of_failing():
    # a prompt of 10 and 20 new tokens need 30 positions, more than block_size 16: the cache
    # rolls and gives the ids of cropped no-cache greedy decoding, with no error mid-loop
    model = tiny_model(block_size=16)
    prompt = torch.randint(0, 65, (1, 10))
    out = generate(model, prompt, 20, do_sample=False)
    assert out.shape == (1, 30)
    assert torch.equal(out, greedy_by_full_forward(model, prompt, 20))


@pytest.mark.parametrize("pos", ["learned", "sinusoidal", "rope"])
def test_left_padded_batch_matches_each_prompt_alone(pos):
    # prompts of lengths 3 and 6, the short one left-padded to 6: a pad query has no key to
    # attend to, which must not give NaN, and the real tokens' logits must be unaffected
    model = randomize(tiny_model(pos_encoding=pos), seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.4)
    short, long = torch.randint(0, 65, (1, 3)), torch.randint(0, 65, (1, 6))
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    cache = KVCache(model.config, 2, "cpu", torch.float32)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model.forward_cached(batch, cache, positions, mask.bool())
    assert torch.isfinite(logits).all()
    assert torch.allclose(logits[0, 3:], model(short)[0][0], atol=1e-5, rtol=1e-5)
    assert torch.allclose(logits[1], model(long)[0][0], atol=1e-5, rtol=1e-5)
    together = generate(model, batch, 8, do_sample=False, attention_mask=mask)
    assert torch.equal(together[0, 3:], generate(model, short, 8, do_sample=False)[0])
    assert torch.equal(together[1], generate(model, long, 8, do_sample=False)[0])
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, batch, 2, attention_mask=torch.tensor([[1, 1, 1, 0, 0, 0]] * 2))


@pytest.mark.parametrize("pos", ["learned", "sinusoidal", "rope"])
def test_compiled_decoding_gives_the_tokens_of_the_full_forward(pos, capfd, monkeypatch):
    from torch._dynamo.utils import counters

    trims = []  # the memory compiling freed is given back after each compile
    monkeypatch.setattr(steps, "give_back_freed_memory", lambda: trims.append(1) or True)
    torch._dynamo.reset()  # compile afresh: torch keeps at most 8 variants of the step
    counters.clear()
    model = halved_random_model(3, block_size=16, pos_encoding=pos)
    prompt = torch.randint(0, 65, (1, 5))
    expected = greedy_by_full_forward(model, prompt, 30)  # 35 > 16: the context slides
    compiled = prepare_for_decoding(copy.deepcopy(model), compile=True)
    assert torch.equal(generate(compiled, prompt, 30, do_sample=False), expected)
    # the step (every cache length, the full one too) and the prompt pass (the prompt, and
    # the windows the context slides to): one graph each
    assert counters["stats"]["unique_graphs"] == 2
    said = [line for line in capfd.readouterr().err.splitlines() if "decoding step" in line]
    assert said[0] == "decoderlm: compiling the decoding step (once per model in this process)..."
    assert re.fullmatch(r"decoderlm: decoding step compiled in \d+\.\d s", said[1])
    assert len(said) == 2  # the compile is paid (and said) once per model
    assert trims == [1, 1]  # after each compile
    batch, mask = torch.randint(0, 65, (2, 6)), torch.ones(2, 6, dtype=torch.long)
    mask[0, :3] = 0  # left padding: compiled with a key mask
    assert torch.equal(
        generate(compiled, batch, 8, do_sample=False, attention_mask=mask),
        generate(model, batch, 8, do_sample=False, attention_mask=mask),
    )


@pytest.mark.parametrize("dtype, quantize", [("bfloat16", None), (None, "int8")])
def test_two_models_of_the_same_shapes_each_decode_compiled_with_their_own_weights(dtype, quantize):
    """The compiled CPU step freezes a model's weights into its graph (packed copies of
    them); a second model of the same shapes (another seed, as a fine-tuned copy of a
    checkpoint would be) compiled in the same process must not be handed the first one's
    frozen graph from torch's graph cache: each decodes the tokens of its own eager step."""
    torch._dynamo.reset()
    prompt = torch.randint(0, 65, (1, 4))
    for seed in (5, 6):  # the same shapes, other weights
        model = halved_random_model(seed, block_size=16)
        eager = prepare_for_decoding(copy.deepcopy(model), dtype, quantize)
        compiled = prepare_for_decoding(model, dtype, quantize, compile=True)
        expected = generate(eager, prompt, 10, do_sample=False)
        assert torch.equal(generate(compiled, prompt, 10, do_sample=False), expected), seed


def test_compiled_bfloat16_steps_give_the_logits_of_eager_steps():
    from decoderlm.generation.steps import decode_step

    torch._dynamo.reset()
    model = halved_random_model(4, block_size=32).to(torch.bfloat16)
    ids = torch.randint(0, 65, (1, 20))
    logits = {}
    for compile in (False, True):
        step, cache = decode_step(compile), KVCache(model.config, 1, "cpu", torch.bfloat16)
        with torch.no_grad():
            model.forward_cached(ids[:, :4], cache, torch.arange(4)[None])
            logits[compile] = torch.cat(
                [
                    step(model, ids[:, t : t + 1], cache, torch.tensor([[t]]), None)
                    for t in range(4, 20)
                ]
            )
    eager, compiled = logits[False].float(), logits[True].float()
    assert eager.abs().max() > 1  # logits of a sane size, so the tolerance below means something
    assert torch.allclose(compiled, eager, atol=0.05, rtol=0.02)
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))


def test_compiled_bfloat16_decoding_compiles_once_across_the_attention_threshold(monkeypatch):
    """The eager step picks the written-out one-query attention once the cache holds enough
    keys; the compiled step must not make that choice by the cache's length (a guard on it
    compiles the step again as the cache grows past the threshold): with recompiling made an
    error, decoding past the threshold still runs and gives the eager tokens."""
    import decoderlm.model.model as model_module
    from decoderlm.generation import steps

    torch._dynamo.reset()
    model = halved_random_model(4, block_size=32).to(torch.bfloat16)
    c = model.config
    monkeypatch.setattr(model_module, "native_bfloat16", lambda: True)  # where it is chosen
    monkeypatch.setattr(model_module, "ONE_QUERY_MIN_ELEMENTS", c.n_kv_heads * 12 * c.head_dim)
    ids = torch.randint(0, 65, (1, 24))
    tokens = {}
    for compile in (False, True):
        step, cache = steps.decode_step(compile), KVCache(c, 1, "cpu", torch.bfloat16)
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            model.forward_cached(ids[:, :4], cache, torch.arange(4)[None])
            tokens[compile] = [
                step(model, ids[:, t : t + 1], cache, torch.tensor([[t]]), None).argmax(-1)
                for t in range(4, 24)  # the cache passes 12 keys at t = 12
            ]
    assert torch.equal(torch.cat(tokens[True]), torch.cat(tokens[False]))


def test_slot_cache_rows_of_different_lengths_give_each_rows_own_logits():
    model = tiny_model(seed=5)
    seqs = [[1, 2, 3, 4, 5], [6], [7, 8, 9], [10, 11]]
    slots = SlotKVCache(model.config, 4, "cpu", torch.float32)
    with torch.no_grad():
        for ids in seqs:  # each prefilled alone, all but its last token
            cache = KVCache(model.config, 1, "cpu", torch.float32)
            if len(ids) > 1:
                model.forward_cached(
                    torch.tensor([ids[:-1]]), cache, torch.arange(len(ids) - 1)[None]
                )
            slots.put(cache)
        slots.remove(1)  # the last row moves into row 1
        rows = [seqs[0], seqs[3], seqs[2]]
        last = torch.tensor([[ids[-1]] for ids in rows])
        logits = model.forward_cached(last, slots, slots.lengths[:, None].clone())
        for i, ids in enumerate(rows):
            alone = model(torch.tensor([ids]))[0][0, -1]
            assert torch.isfinite(logits).all()
            assert torch.allclose(logits[i, -1], alone, atol=1e-5)
    assert slots.lengths.tolist() == [5, 2, 3]


def test_compiled_steps_of_two_models_of_one_depth_never_share_a_graph():
    """The compiled step leaves out torch.compile's guards on the model's modules; each model
    must still get its own graph: a swiglu model decoded compiled after a gelu model of the
    same depth gives its own eager tokens (a shared graph would run the gelu MLP on it)."""
    torch._dynamo.reset()
    prompt = torch.randint(0, 65, (1, 5))
    for mlp in ("gelu", "swiglu"):
        model = halved_random_model(4, block_size=32, mlp=mlp, pos_encoding="rope")
        compiled = prepare_for_decoding(copy.deepcopy(model), compile=True)
        expected = generate(model, prompt, 12, do_sample=False)
        assert torch.equal(generate(compiled, prompt, 12, do_sample=False), expected)


def test_a_llama_shaped_step_reads_gate_and_up_in_one_product():
    """A bias-free SwiGLU MLP's gate and up products read the same input: the compiled CPU
    step makes them one product over their frozen weights, concatenated. The graph inductor
    generates code from then holds 4 products a layer (qkv, output, gate and up, down) and
    the unembedding, and the greedy tokens stay the eager model's."""
    import torch._inductor.config as inductor_config

    products = []

    def count_products(graph):  # inductor's last look at the graph before its code
        calls = [str(n.target) for n in graph.nodes if n.op == "call_function"]
        products.append(sum("mm" in c or "linear" in c for c in calls))

    torch._dynamo.reset()
    shape = dict(mlp="swiglu", norm="rmsnorm", pos_encoding="rope", n_kv_heads=2, bias=False)
    model = halved_random_model(4, block_size=32, n_layers=2, n_heads=4, **shape)
    compiled = prepare_for_decoding(copy.deepcopy(model), compile=True)
    prompt = torch.randint(0, 65, (1, 5))
    with inductor_config.patch(post_grad_custom_post_pass=count_products):
        tokens = generate(compiled, prompt, 12, do_sample=False)
    assert torch.equal(tokens, generate(model, prompt, 12, do_sample=False))
    # the prompt pass's graph, whose products are the layers' eager ones (none of inductor's),
    # then the step's: 2 * 5 + 1 with gate and up apart
    assert products == [0, 2 * 4 + 1]


def test_a_hook_attached_after_compiling_still_runs_while_decoding():
    """Hooks added to a model whose compiled step already exists run at every decoding step
    (the step then runs eagerly), and the tokens stay those of the eager model."""
    torch._dynamo.reset()
    model = halved_random_model(4, block_size=32)
    compiled = prepare_for_decoding(copy.deepcopy(model), compile=True)
    prompt = torch.randint(0, 65, (1, 5))
    generate(compiled, prompt, 3, do_sample=False)  # compiles the step
    seen, before = [], []
    handle = compiled.blocks[0].attn.hook_z.register_forward_hook(lambda m, i, o: seen.append(1))
    try:
        tokens = generate(compiled, prompt, 6, do_sample=False)
    finally:
        handle.remove()
    assert len(seen) == 6  # the prompt's pass and five one-token steps
    assert torch.equal(tokens, generate(model, prompt, 6, do_sample=False))
    handle = compiled.blocks[1].mlp.register_forward_pre_hook(lambda m, i: before.append(1))
    try:
        tokens = generate(compiled, prompt, 4, do_sample=False)
    finally:
        handle.remove()
    assert len(before) == 4  # a pre-hook, on another module, runs too
    assert len(seen) == 6  # the removed hook no longer runs


def test_a_compiled_step_compiles_once_for_every_cache_capacity_and_window():
    """The compiled step's cache is sized to each call's prompt and new tokens, and each step
    attends over a window of it that grows by 64 positions. A first window equal to head_dim
    (64 and 64) must not make the window a constant of the compiled graph (shape symbols
    shared by value), nor may a first window as long as the cache's buffers make the graph
    guard on that equality: with recompiling made an error, a longer generation (a larger
    capacity, windows of 64 and 128 positions) still runs and gives the eager tokens."""
    torch._dynamo.reset()
    model = tiny_model(block_size=256, n_heads=2, d_model=128)  # head_dim 64
    compiled = prepare_for_decoding(copy.deepcopy(model), compile=True)
    prompt = torch.randint(0, 65, (1, 8))
    assert torch.equal(
        generate(compiled, prompt, 8, do_sample=False), generate(model, prompt, 8, do_sample=False)
    )
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = generate(compiled, prompt, 80, do_sample=False)  # 88 positions: capacity 129
    assert torch.equal(got, generate(model, prompt, 80, do_sample=False))
