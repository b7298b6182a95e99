import pytest
import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.model.analysis import flops_per_token, memory_bytes, mfu
from decoderlm.presets import PRESETS

from conftest import tiny_config


def test_flops_per_token_of_tiny_under_the_palm_and_kaplan_conventions():
    # the tiny model: N = 104,256 non-embedding parameters, L 2, H 4, Q 16, T 32. PaLM counts
    # the full T x T attention (6N + 12 L H Q T); Kaplan halves that term for the causal mask
    cfg = tiny_config()
    palm = flops_per_token(cfg, 32, "palm")
    kaplan = flops_per_token(cfg, 32, "kaplan")
    assert palm["n_matmul_params"] == 104_256
    assert palm["training"] == 6 * 104_256 + 12 * 2 * 4 * 16 * 32 == 674_688
    assert kaplan["training"] == 650_112
    assert (palm["training"] - 6 * 104_256) == 2 * (kaplan["training"] - 6 * 104_256)
    assert mfu(palm["training"], 1_000, 1e12) == pytest.approx(6.74688e-4)
    assert kaplan["training_per_sequence"] == 650_112 * 32
    with pytest.raises(ValueError, match="convention"):
        flops_per_token(cfg, 32, "chinchilla")
    with pytest.raises(ValueError, match="block_size=32"):
        flops_per_token(cfg, 33)
    longer = ModelConfig(**{**cfg.to_dict(), "pos_encoding": "rope", "max_positions": 64})
    assert flops_per_token(longer, 64)["forward_per_sequence"] > 0
    with pytest.raises(ValueError, match="max_positions=64"):
        flops_per_token(longer, 65)


def test_matmul_flops_match_a_count_of_the_model_s_matmuls():
    # an independent count: 2 x (in x out) per token for every Linear, plus QK^T and AV
    cfg = ModelConfig(
        vocab_size=300,
        block_size=64,
        n_layers=3,
        n_heads=4,
        d_model=32,
        tie_embeddings=False,
        bias=False,
        norm="rmsnorm",
    )
    model = DecoderLM(cfg)
    linear = sum(
        2 * m.in_features * m.out_features
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    )
    T = 64
    full_attention = cfg.n_layers * 2 * (2 * T * cfg.d_model)  # QK^T and AV over T keys
    palm = flops_per_token(cfg, T, "palm")["forward"]
    norms = 2 * (2 * cfg.n_layers + 1) * cfg.d_model  # the norm gains counted in N
    assert palm == linear + full_attention + norms


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"norm_position": "post"},
        {"dropout": 0.1},
        {"mlp": "swiglu", "norm": "rmsnorm", "pos_encoding": "rope", "bias": False},
    ],
)
def test_activation_estimate_is_within_20_percent_of_what_autograd_saves(overrides):
    cfg = ModelConfig(
        vocab_size=500, block_size=128, n_layers=3, n_heads=4, d_model=64, **overrides
    )
    model = DecoderLM(cfg).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    idx = torch.randint(0, 500, (4, 128))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    estimate = memory_bytes(cfg, 4, 128)["activations"]
    assert 0.8 < estimate / sum(saved.values()) < 1.2


def test_weights_gradients_and_adamw_state_match_the_real_tensors():
    cfg = tiny_config(tie_embeddings=False)
    model = DecoderLM(cfg)
    opt = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, 65, (2, 32))
    model(idx, idx)[1].backward()
    opt.step()
    mem = memory_bytes(cfg, 2, 32, "fp32")
    assert mem["weights"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert mem["gradients"] == sum(
        p.grad.numel() * p.grad.element_size() for p in model.parameters()
    )
    assert mem["adamw"] == sum(
        s[k].numel() * s[k].element_size()
        for s in opt.state.values()
        for k in ("exp_avg", "exp_avg_sq")
    )
    assert memory_bytes(cfg, 2, 32, "bf16")["weights"] == mem["weights"] // 2


def test_memory_is_linear_in_T_without_dropout_and_checkpointing_helps():
    cfg = PRESETS["gpt2"].model
    cfg = ModelConfig(**cfg)
    a = memory_bytes(cfg, 1, 256)["activations"]
    b = memory_bytes(cfg, 1, 512)["activations"]
    assert b == 2 * a
    assert memory_bytes(cfg, 1, 512, activation_checkpointing=True)["activations"] < 0.6 * b
    # KV cache: 2 (k and v) x n_layers x B x T x d_model x bytes
    assert memory_bytes(cfg, 1, 1024, "bf16")["kv_cache"] == 2 * 12 * 1024 * 768 * 2
    assert memory_bytes(cfg, 1, 1024, "f16") == memory_bytes(cfg, 1, 1024, "float16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        memory_bytes(cfg, 1, 8, "int3")


def test_gpt2_presets_have_the_released_sizes():
    expected = {
        "gpt2": 124_439_808,
        "gpt2-medium": 354_823_168,
        "gpt2-large": 774_030_080,
        "gpt2-xl": 1_557_611_200,
    }
    for name, total in expected.items():
        cfg = ModelConfig(**PRESETS[name].model)
        with torch.device("meta"):
            assert DecoderLM(cfg).num_parameters() == total
        assert cfg.activation == "gelu_tanh" and cfg.vocab_size == 50257


def test_params_command(tmp_path, capsys):
    import json

    from decoderlm.cli import main

    assert main(["params", "--preset", "gpt2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"]["total"] == report["parameters_of_modules"] == 124_439_808
    assert (
        report["flops_per_token"]["palm"]["training"]
        > report["flops_per_token"]["kaplan"]["training"]
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model": {**PRESETS["llama-tiny"].model, "n_layers": 2}}))
    assert (
        main(
            [
                "params",
                "--model-config",
                str(config),
                "--batch-size",
                "2",
                "--seq-len",
                "64",
                "--dtype",
                "bf16",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "parameters:" in out and "kv_cache" in out and "GiB" in out
    assert main(["params", "--preset", "gpt2", "--seq-len", "2048"]) == 2
    assert "block_size=1024" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_counts_the_same_by_formula_and_by_modules(name):
    from decoderlm.model.analysis import count_parameters

    cfg = ModelConfig(**PRESETS[name].model)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    assert count_parameters(cfg)["total"] == model.num_parameters()
