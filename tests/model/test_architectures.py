"""The architecture options of Llama, Qwen2 and Mistral checkpoints: grouped-query attention
(n_kv_heads), a head_dim of its own, q/k/v biases (qkv_bias) and Llama 3's rope scaling, each
checked against transformers' own model classes, the NumPy reference, and the old path."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from decoderlm import DecoderLM, ModelConfig
from decoderlm.errors import UserError
from decoderlm.model import reference
from decoderlm.model.analysis import count_parameters, flops_per_token, memory_bytes
from decoderlm.model.hooks import run_with_cache
from decoderlm.model.kv_cache import KVCache, SlotKVCache
from decoderlm.model.model import attention_pattern, one_query_attention
from decoderlm.model.positions import rope_inv_freq
from decoderlm.presets import PRESETS

transformers = pytest.importorskip("transformers")

# original_max_position_embeddings 32 with head_dim 12 and base 10,000 puts the six
# wavelengths 2 pi 10000^(2i/12) (6.3, 29, 135, ...) in all three of Llama 3's regimes:
# kept (< 32 / 4), blended (between 8 and 32) and divided by factor (> 32)
SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
SHAPE = dict(vocab_size=61, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, d_model=32, d_ff=40)


def llama_config(**overrides) -> ModelConfig:
    """A tiny Llama-shaped ModelConfig: GQA 4/2, head_dim 12 != 32 / 4, llama3 scaling."""
    base = dict(
        **SHAPE,
        block_size=64,
        pos_encoding="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        rope_scaling=SCALING,
        norm_eps=1e-6,
    )
    return ModelConfig(**{**base, **overrides})


def hf_config_of(kind: str, config: ModelConfig):
    """transformers' LlamaConfig or Qwen2Config of `config`'s shape (eager attention)."""
    hf_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    rope = {"rope_theta": config.rope_base, **(config.rope_scaling or {"rope_type": "default"})}
    return hf_cls(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.block_size,
        rms_norm_eps=config.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=config.tie_embeddings,
        attn_implementation="eager",
    )


def hf_model(kind: str, config: ModelConfig):
    """transformers' LlamaForCausalLM or Qwen2ForCausalLM of `config`'s shape, float32, eager
    attention, every parameter drawn at random (std 0.2, so biases and gains matter)."""
    torch.manual_seed(0)
    hf_config = hf_config_of(kind, config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def from_hf(hf, config: ModelConfig) -> DecoderLM:
    """Our model with the weights of `hf`, by name; q, k and v concatenate into attn.qkv in
    the order [q (n_heads head_dim), k (n_kv_heads head_dim), v (n_kv_heads head_dim)]."""
    names = {
        "input_layernorm": "ln_1",
        "post_attention_layernorm": "ln_2",
        "self_attn.o_proj": "attn.proj",
        "mlp.gate_proj": "mlp.gate",
        "mlp.up_proj": "mlp.fc",
        "mlp.down_proj": "mlp.proj",
    }
    hf_state = hf.state_dict()
    state = {"tok_emb.weight": hf_state["model.embed_tokens.weight"]}
    state["ln_f.weight"] = hf_state["model.norm.weight"]
    state["lm_head.weight"] = hf_state["lm_head.weight"]
    for i in range(config.n_layers):
        pre = f"model.layers.{i}"
        for theirs, ours in names.items():
            state[f"blocks.{i}.{ours}.weight"] = hf_state[f"{pre}.{theirs}.weight"]
        for kind in ("weight", "bias"):
            parts = [hf_state.get(f"{pre}.self_attn.{x}_proj.{kind}") for x in "qkv"]
            if parts[0] is not None:
                state[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(parts)
    model = DecoderLM(config)
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_logits_equal_transformers_llama_and_qwen2(kind, tied):
    # Qwen2: q/k/v biases and no output bias (qkv_bias, bias false)
    config = llama_config(qkv_bias=kind == "qwen2", tie_embeddings=tied)
    hf = hf_model(kind, config)
    model = from_hf(hf, config)
    idx = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(idx).logits
        got, _ = model(idx)
    assert (got - expected).abs().max() < 1e-4
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    oracle = reference.forward(params, config, idx.numpy())  # written from the formulas
    np.testing.assert_allclose(got.numpy(), oracle, atol=1e-4)
    inv_freq = hf.model.rotary_emb.inv_freq.double()
    torch.testing.assert_close(rope_inv_freq(config), inv_freq, rtol=1e-6, atol=0)


def test_kv_cache_decoding_equals_the_full_forward_and_holds_kv_heads_only():
    config = llama_config(qkv_bias=True)
    hf = hf_model("qwen2", config)
    model = from_hf(hf, config)
    idx = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    cache = KVCache(config, 2, "cpu", torch.float32)
    assert cache.k[0].shape == (2, config.n_kv_heads, config.max_positions + 1, config.head_dim)
    with torch.no_grad():
        full, _ = model(idx)
        steps = [model.forward_cached(idx[:, :12], cache, torch.arange(12).expand(2, 12))]
        for t in range(12, 20):
            steps.append(model.forward_cached(idx[:, t : t + 1], cache, torch.full((2, 1), t)))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    slots = SlotKVCache(config, 4, "cpu", torch.float32)
    assert slots.k[0].shape[1] == config.n_kv_heads


def test_one_query_attention_and_the_pattern_group_query_heads_as_repeat_kv():
    # query head h reads key/value head h // (n_heads / n_kv_heads): repeat_interleave's order
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 6, 5, 8, generator=g), *torch.randn(2, 2, 2, 9, 8, generator=g)
    k_rep, v_rep = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.3
    mask[..., 0] = True
    expected = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask)
    torch.testing.assert_close(one_query_attention(q, k, v, mask), expected)
    square = k[:, :, :5]
    torch.testing.assert_close(
        attention_pattern(q, square), attention_pattern(q, square.repeat_interleave(3, dim=1))
    )


def test_grouped_heads_equal_multi_head_attention_with_repeated_key_value_weights():
    gqa = DecoderLM(llama_config(rope_scaling=None, qkv_bias=True)).eval()
    mha = DecoderLM(llama_config(rope_scaling=None, qkv_bias=True, n_kv_heads=4)).eval()
    H, H_kv, D = 4, 2, 12
    state = gqa.state_dict()
    for i in range(2):
        for kind in ("weight", "bias"):
            qkv = state[f"blocks.{i}.attn.qkv.{kind}"]
            q, k, v = qkv.split([H * D, H_kv * D, H_kv * D])
            rep = [
                t.unflatten(0, (H_kv, D)).repeat_interleave(2, dim=0).flatten(0, 1) for t in (k, v)
            ]
            state[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat([q, *rep])
    mha.load_state_dict(state)
    idx = torch.randint(0, 61, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(gqa(idx)[0], mha(idx)[0])


def test_n_kv_heads_equal_to_n_heads_is_the_old_multi_head_path(tmp_path):
    # a run directory written before these options existed has none of them in config.json
    old = ModelConfig(vocab_size=61, block_size=32, n_layers=2, n_heads=4, d_model=32)
    torch.manual_seed(5)
    model = DecoderLM(old).eval()
    model.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    section = data.get("model", data)
    for key in ("n_kv_heads", "head_dim", "qkv_bias", "rope_scaling"):
        section.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(data))
    loaded = DecoderLM.from_pretrained(tmp_path)
    assert (loaded.config.n_kv_heads, loaded.config.head_dim) == (4, 8)
    assert loaded.config == ModelConfig(**{**old.to_dict(), "n_kv_heads": 4, "head_dim": 8})
    assert loaded.blocks[0].attn.qkv.weight.shape == (96, 32)
    idx = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx)[0], model(idx)[0], rtol=0, atol=0)
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    np.testing.assert_allclose(
        loaded(idx)[0].detach().numpy(), reference.forward(params, old, idx.numpy()), atol=1e-5
    )


def test_hooks_keep_key_value_heads_grouped():
    config = llama_config()
    model = DecoderLM(config).eval()
    idx = torch.randint(0, 61, (2, 7))
    _, cache = run_with_cache(model, idx)
    assert cache["blocks.0.attn.hook_q"].shape == (2, 7, 4, 12)
    for name in ("hook_k", "hook_v", "hook_rot_k"):
        assert cache[f"blocks.0.attn.{name}"].shape == (2, 7, 2, 12), name  # TransformerLens's
    assert cache["blocks.0.attn.hook_z"].shape == (2, 7, 4, 12)
    assert cache["blocks.0.attn.hook_pattern"].shape == (2, 4, 7, 7)


HF_PRESETS = {"smollm2-135m": "llama", "qwen2.5-0.5b": "qwen2", "llama-3.2-1b": "llama"}


@pytest.mark.parametrize("name", sorted(HF_PRESETS))
def test_presets_count_the_parameters_of_transformers_models(name):
    config = ModelConfig(**PRESETS[name].model)
    kind = HF_PRESETS[name]  # Qwen2ForCausalLM has q/k/v biases and no output bias, always
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config_of(kind, config))
        ours = DecoderLM(config).num_parameters()
    total = sum(p.numel() for p in hf.parameters())  # a tied matrix is one parameter
    assert count_parameters(config)["total"] == ours == total


def test_kv_cache_memory_and_attention_flops_follow_the_heads():
    config = llama_config(block_size=16, tie_embeddings=False)
    B, T = 3, 16
    cache = KVCache(config, B, "cpu", torch.bfloat16)
    held = sum(t[:, :, :T].numel() * t.element_size() for t in (*cache.k, *cache.v))
    assert memory_bytes(config, B, T, "bf16")["kv_cache"] == held
    # PaLM's convention counts every T x T score: the matmuls torch runs, less the 2 FLOPs per
    # token of each norm gain (counted in N, multiplied elementwise, not by a matmul)
    model = DecoderLM(config)
    for block in model.blocks:
        block.attn.impl = "explicit"  # written-out matmuls, which the counter sees
    idx = torch.randint(0, 61, (1, T))
    with FlopCounterMode(display=False) as counter:
        model(idx)
    norms = count_parameters(config)["norms"]
    palm = flops_per_token(config, T, "palm")["forward_per_sequence"]
    assert counter.get_total_flops() == palm - 2 * T * norms


def test_validation_names_the_problem():
    with pytest.raises(UserError, match=r"n_kv_heads \(3\) must divide n_heads \(4\)"):
        llama_config(n_kv_heads=3)
    with pytest.raises(UserError, match="rope needs an even head_dim, got head_dim = 7"):
        llama_config(head_dim=7)
    with pytest.raises(UserError, match="rope_type 'llama3'"):
        llama_config(rope_scaling={**SCALING, "rope_type": "yarn"})
    with pytest.raises(UserError, match="needs pos_encoding 'rope'"):
        llama_config(pos_encoding="learned", rope_scaling=SCALING)
    with pytest.raises(UserError, match="needs exactly the keys"):
        llama_config(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(UserError, match="high_freq_factor > low_freq_factor"):
        llama_config(rope_scaling={**SCALING, "high_freq_factor": 1.0})
    # head_dim set: d_model need not be a multiple of n_heads
    assert llama_config(d_model=30, n_heads=4, head_dim=8).head_dim == 8


def test_train_flags_build_the_architecture_and_export_refuses_it(tmp_path, capsys):
    from decoderlm.cli import main
    from decoderlm.io.targets import export_target

    data = tmp_path / "tiny.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    out = tmp_path / "run"
    scaling = json.dumps({**SCALING, "original_max_position_embeddings": 8})
    flags = ["--n-layers", "1", "--n-heads", "4", "--n-kv-heads", "2", "--head-dim", "6"]
    flags += ["--d-model", "16", "--qkv-bias", "--rope-scaling", scaling, "--block-size", "16"]
    flags += ["--batch-size", "4", "--max-steps", "2", "--eval-interval", "2", "--no-progress"]
    assert main(["train", "--data", str(data), "--out", str(out), *flags]) == 0
    # the export line names the flags the exporters need (beside the default preset's own):
    # gguf's qwen2 (llama with q/k/v biases) has no rope scaling
    assert "--bias false --rope-scaling none (as llama)" in capsys.readouterr().out
    model = DecoderLM.from_pretrained(out)
    c = model.config
    assert (c.n_kv_heads, c.head_dim, c.qkv_bias, c.rope_scaling["factor"]) == (2, 6, True, 8)
    assert model.blocks[0].attn.qkv.weight.shape == ((4 + 2 * 2) * 6, 16)
    assert model.blocks[0].attn.proj.weight.shape == (16, 24)
    # hf's and gguf's Llama write GQA, head_dim and biases (tests/io/test_gguf_llama.py);
    # the default preset's own options still block them, and gguf's qwen2 the rope scaling
    for format, words in (("hf", "QK-norm"), ("gguf", "rope scaling")):
        with pytest.raises(UserError, match=words) as error:
            export_target(c, format)
        assert "\n" not in str(error.value)
    assert main(["train", "--data", str(data), "--rope-scaling", "{factor: 8}", *flags]) == 2
    assert "expected a JSON object" in capsys.readouterr().err
    assert main(["params", "--run", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"]["total"] == report["parameters_of_modules"]
