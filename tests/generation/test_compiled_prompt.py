"""The compiled prompt pass of a model whose decoding step is compiled (`steps.prefill`)."""

import copy

import pytest
import torch

from decoderlm.generation import cpu_decode, steps
from decoderlm.generation.precision import activation_dtype, prepare_for_decoding
from decoderlm.model.kv_cache import KVCache

from conftest import halved_random_model

GQA = dict(n_heads=4, n_kv_heads=2, pos_encoding="rope", norm="rmsnorm", mlp="swiglu", bias=False)


def _eager_prefill(model, ids):
    """The oracle: the prepared model's own eager pass over ids into a new cache."""
    cache = KVCache(model.config, 1, "cpu", activation_dtype(model), ids.size(1) + 4)
    logits = model.forward_cached(ids, cache, torch.arange(ids.size(1))[None], last_only=True)
    return cache, logits[:, -1]


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_one_compiled_graph_gives_the_eager_logits_and_cache_for_every_prompt_length(
    dtype, monkeypatch, capfd
):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # d_model 512: block matrices of 2^18 elements, which the eager products pack
    model = prepare_for_decoding(
        halved_random_model(7, d_model=512, n_layers=1, **GQA), dtype, compile=True
    )
    runs = []  # each product of the graph is the layer's eager forward, called from it
    real = cpu_decode.DecodeLinear.forward

    def forward(self, x):
        if not torch.compiler.is_compiling() and cpu_decode._in_prompt:
            runs.append(self)
        return real(self, x)

    monkeypatch.setattr(cpu_decode.DecodeLinear, "forward", forward)
    ids = torch.randint(0, 65, (1, 12), generator=torch.Generator().manual_seed(0))
    linears = [m for m in model.modules() if isinstance(m, cpu_decode.DecodeLinear)]
    tolerance = 1e-4 if dtype is None else 0.05
    with torch.no_grad():
        for T in (9, 12, 2):  # 2: the shortest prompt the compiled pass takes
            cache, positions, logits = steps.prefill(model, ids[:, :T], capacity=T + 4)
            expected_cache, expected = _eager_prefill(model, ids[:, :T])
            assert cache.length == T and torch.equal(positions, torch.arange(T)[None])
            assert torch.allclose(logits.float(), expected.float(), atol=tolerance), T
            pairs = zip(cache.k + cache.v, expected_cache.k + expected_cache.v, strict=True)
            for got, want in pairs:
                assert torch.allclose(got[:, :, :T].float(), want[:, :, :T].float(), atol=tolerance)
    assert expected.float().abs().max() > 1  # logits of a sane size: the tolerance means something
    # qkv, proj, gate, up, down and the unembedding, once a pass each
    assert sorted(map(id, runs)) == sorted(map(id, 3 * linears))
    assert counters["stats"]["unique_graphs"] == 1  # a length traced as a symbol
    said = [line for line in capfd.readouterr().err.splitlines() if "prompt pass" in line]
    assert said[0] == "decoderlm: compiling the prompt pass (once per model in this process)..."
    assert said[1].startswith("decoderlm: prompt pass compiled in ") and len(said) == 2


def test_prompts_the_compiled_pass_does_not_take_run_eagerly():
    # one token (a length of 1 would compile a graph of its own), several rows, padding,
    # a hook to run, autograd, a model whose step is not compiled: no prompt graph at all
    torch._dynamo.reset()
    model = halved_random_model(3, block_size=16, **GQA)
    compiled = prepare_for_decoding(copy.deepcopy(model), compile=True)
    eager = prepare_for_decoding(copy.deepcopy(model))
    ids = torch.randint(0, 65, (2, 6), generator=torch.Generator().manual_seed(1))
    padding = torch.ones(2, 6, dtype=torch.bool)
    padding[0, :2] = False
    with torch.no_grad():
        for prompt, mask in ((ids[:1, :1], None), (ids, None), (ids, padding)):
            got = steps.prefill(compiled, prompt, mask)[2]
            assert torch.allclose(got, steps.prefill(eager, prompt, mask)[2], atol=1e-5)
        handle = compiled.blocks[0].hook_resid_pre.register_forward_hook(lambda *a: None)
        steps.prefill(compiled, ids[:1])
        handle.remove()
        steps.prefill(eager, ids[:1])
    steps.prefill(compiled, ids[:1])  # autograd on
    assert "prompt" not in steps._compiled.get(compiled, {})
    assert "prompt" not in steps._compiled.get(eager, {})
    assert not cpu_decode._in_prompt  # the flag the graph is traced under is down again


def test_each_layer_is_numbered_once_and_a_copy_gets_numbers_of_its_own():
    # the graph calls each product by its layer's number; a copy of a numbered model (its
    # numbers copied with it) must not call the original's layers
    model = prepare_for_decoding(halved_random_model(2, **GQA), compile=True)

    def numbered(m):
        cpu_decode.number_layers(m)
        layers = [x for x in m.modules() if getattr(x, "eager_in_prompt_graph", False)]
        return layers, [layer.prompt_key for layer in layers]

    layers, keys = numbered(model)
    assert len(layers) == 5 * model.config.n_layers + 1  # qkv, proj, gate, up, down; the head
    assert keys == list(range(keys[0], keys[0] + len(layers)))  # in the modules' order
    assert numbered(model)[1] == keys  # kept
    copied, copied_keys = numbered(copy.deepcopy(model))
    assert not set(keys) & set(copied_keys)
    with torch.no_grad():
        for layer in layers + copied:
            x = torch.randn(3, layer.in_features)
            assert torch.equal(cpu_decode._run_layer(x, layer.prompt_key), layer(x))
