"""LoRA adapters (decoderlm.model.lora): the update W + (alpha / r) B A, step 0 equal to the base,
merging, the closed-form parameter count, target matching."""

import pytest
import torch
import torch.nn as nn

from decoderlm.model.lora import (
    LoRALinear,
    apply_lora,
    is_lora_key,
    lora_parameter_count,
    merge_lora,
    parse_targets,
)

from conftest import randomize, tiny_model


def adapted(rank=4, alpha=8.0, targets="qkv,proj,fc", seed=0, **overrides):
    """(base model, a randomized copy with adapters whose B is random too)."""
    base = randomize(tiny_model(**overrides), seed=seed)
    model = randomize(tiny_model(**overrides), seed=seed)
    apply_lora(model, rank, alpha, targets)
    return base, model


def test_step_0_gives_exactly_the_base_models_logits():
    base, model = adapted()
    idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    model.train()  # also in training mode: B = 0, so nothing is added
    base.train()
    assert torch.equal(model(idx)[0], base(idx)[0])
    assert all(torch.equal(m.lora_B, torch.zeros_like(m.lora_B)) for m in lora_layers(model))


def lora_layers(model):
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def test_an_adapted_layer_computes_eq_3_and_merges_to_the_same_function():
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(6, 5)
    layer = LoRALinear(linear, rank=3, alpha=6.0)
    with torch.no_grad():
        layer.lora_B.copy_(torch.randn(5, 3, generator=g))
    x = torch.randn(4, 6, generator=g, dtype=torch.float32)
    W, b, A, B = (
        t.detach().double() for t in (linear.weight, linear.bias, layer.lora_A, layer.lora_B)
    )
    expected = x.double() @ (W + (6.0 / 3) * B @ A).T + b  # Hu et al. 2021, eq. 3 with alpha / r
    assert torch.allclose(layer(x).double(), expected, atol=1e-6)
    merged = layer.merged()
    assert type(merged) is nn.Linear
    assert torch.allclose(merged(x).double(), expected, atol=1e-6)


def test_the_same_update_as_peft():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 12))
    ours = LoRALinear(net[0], rank=2, alpha=4.0)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0"], lora_dropout=0.0)
    theirs = peft.get_peft_model(nn.Sequential(nn.Linear(8, 12)), config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        inner = theirs.base_model.model[0]
        inner.base_layer.weight.copy_(net[0].weight)
        inner.base_layer.bias.copy_(net[0].bias)
        ours.lora_B.copy_(torch.randn(12, 2, generator=g))
        inner.lora_A["default"].weight.copy_(ours.lora_A)
        inner.lora_B["default"].weight.copy_(ours.lora_B)
    x = torch.randn(3, 8, generator=g)
    assert torch.allclose(ours(x), theirs(x), atol=1e-6)


def test_merged_model_gives_the_adapted_models_logits():
    _, model = adapted()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in lora_layers(model):
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.1)
    idx = torch.randint(0, 65, (2, 16), generator=g)
    adapted_logits = model(idx)[0]
    merge_lora(model)
    assert not lora_layers(model) and not any(is_lora_key(k) for k in model.state_dict())
    assert (model(idx)[0] - adapted_logits).abs().max() < 1e-5


def test_only_adapters_train_and_their_count_is_the_closed_form():
    base, model = adapted(rank=3, targets="qkv,attn.proj,fc")
    d, L = 64, 2  # tiny_config: d_model 64, d_ff 256, 2 layers
    expected = L * (3 * (d + 3 * d) + 3 * (d + d) + 3 * (d + 4 * d))  # r (d_in + d_out) each
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == expected
    shapes = [(m.out_features, m.in_features) for m in lora_layers(model)]
    assert lora_parameter_count(shapes, 3) == expected and len(shapes) == 3 * L
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(is_lora_key(n) for n in names)
    # the base tensors keep their names, so the base model's state dict loads into the adapted one
    base_keys = set(base.state_dict())
    assert base_keys == {k for k in model.state_dict() if not is_lora_key(k)}


def test_targets_by_the_end_of_the_module_name():
    _, model = adapted(targets="proj")
    names = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert names == {f"blocks.{i}.{part}.proj" for i in range(2) for part in ("attn", "mlp")}
    _, model = adapted(targets="blocks.1.mlp.proj")
    assert [n for n, m in model.named_modules() if isinstance(m, LoRALinear)] == [
        "blocks.1.mlp.proj"
    ]
    assert parse_targets(" qkv, fc ,") == ["qkv", "fc"]


@pytest.mark.parametrize(
    "rank, targets, fragment",
    [
        (0, "qkv", "lora_rank must be a positive integer"),
        (65, "qkv", r"lora_rank 65 is above min\(d_out, d_in\) = 64 of blocks.0.attn.qkv"),
        (4, "nope", "'nope' matches no linear layer"),
        (4, "lm_head", "shares its weight with the token embedding"),
        (4, ",", "names no layer"),
    ],
)
def test_bad_settings_are_refused_before_changing_the_model(rank, targets, fragment):
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=fragment):
        apply_lora(model, rank, 8.0, targets)
    assert not lora_layers(model) and all(p.requires_grad for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_untied_head_may_be_adapted():
    _, model = adapted(targets="lm_head", tie_embeddings=False)
    assert [n for n, m in model.named_modules() if isinstance(m, LoRALinear)] == ["lm_head"]


def _gqa_model(**overrides):
    """A randomized tiny Llama-shaped model with grouped-query attention: 4 query heads, 2
    key/value heads of 16 (q rows 0..63, k 64..95, v 96..127 of the fused qkv)."""
    options = dict(n_heads=4, n_kv_heads=2, pos_encoding="rope", norm="rmsnorm", mlp="swiglu")
    options.update(bias=False, tie_embeddings=False, **overrides)
    return randomize(tiny_model(**options), seed=0)


def test_q_and_v_adapt_their_rows_of_the_fused_qkv_only():
    model = _gqa_model()
    names = apply_lora(model, 2, 4.0, "q,v")
    assert names == [f"blocks.{i}.attn.qkv.{p}" for i in range(2) for p in ("q", "v")]
    layer = model.blocks[0].attn.qkv
    assert layer.rows == {"q": (0, 64), "v": (96, 128)}
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g))
    A, B = layer.lora_A.detach().double(), layer.lora_B.detach().double()
    expected = torch.zeros(128, 64, dtype=torch.float64)  # k's rows 64..95 are not touched
    expected[0:64] = 2.0 * B[:64] @ A[:2]  # scale alpha / r = 2, Hu et al. eq. 3 per part
    expected[96:128] = 2.0 * B[64:] @ A[2:]
    assert torch.allclose(layer.delta_weight().double(), expected, atol=1e-6)
    x = torch.randn(3, 64, generator=g)
    W = layer.weight.detach().double()
    assert torch.allclose(layer(x).double(), x.double() @ (W + expected).T, atol=1e-5)
    assert torch.allclose(layer.merged()(x).double(), x.double() @ (W + expected).T, atol=1e-5)
    # the recorded names rebuild the same adapters (how an adapter directory is read back)
    again = _gqa_model()
    assert apply_lora(again, 2, 4.0, names) == names
    assert {k: v.shape for k, v in again.state_dict().items()} == {
        k: v.shape for k, v in model.state_dict().items()
    }


def test_llama_names_and_peft_names_pick_the_same_layers():
    ours = _gqa_model()
    names = apply_lora(ours, 2, 4.0, "q,k,v,o,gate,up,down")
    theirs = _gqa_model()
    proj = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    assert apply_lora(theirs, 2, 4.0, proj) == names
    per_block = {n.split(".", 2)[2] for n in names}
    assert per_block == {
        "attn.qkv.q", "attn.qkv.k", "attn.qkv.v", "attn.proj", "mlp.gate", "mlp.fc", "mlp.proj"
    }  # fmt: skip


def test_a_layer_named_whole_and_by_parts_is_refused():
    with pytest.raises(ValueError, match="both whole and by its q/k/v parts"):
        apply_lora(_gqa_model(), 2, 4.0, "qkv,q")


_LLAMA_NAMES = {
    "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.proj": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj", "mlp.fc": "mlp.up_proj", "mlp.proj": "mlp.down_proj",
}  # fmt: skip


def _as_llama(state: dict) -> dict:
    """Our GQA model's state dict under transformers LlamaForCausalLM's names, written out here
    (not the exporter's) so that this test checks the row layout on its own."""
    out = {"model.embed_tokens.weight": state["tok_emb.weight"]}
    out |= {"model.norm.weight": state["ln_f.weight"], "lm_head.weight": state["lm_head.weight"]}
    for key, tensor in state.items():
        if not key.startswith("blocks."):
            continue
        _, i, rest = key.split(".", 2)
        prefix, module = f"model.layers.{i}.", rest.rsplit(".", 1)[0]
        if module == "attn.qkv":
            for name, part in zip("qkv", tensor.split([64, 32, 32]), strict=True):
                out[f"{prefix}self_attn.{name}_proj.weight"] = part
        else:
            out[f"{prefix}{_LLAMA_NAMES[module]}.weight"] = tensor
    return out


def test_the_same_q_v_update_as_peft_on_transformers_llama():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    ours = _gqa_model(block_size=16)
    hf_config = transformers.LlamaConfig(
        vocab_size=65, hidden_size=64, intermediate_size=ours.config.d_ff, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=ours.config.norm_eps, rope_theta=ours.config.rope_base,
        max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.load_state_dict(_as_llama(ours.state_dict()), strict=True)
    apply_lora(ours, 2, 4.0, "q,v")
    theirs = peft.get_peft_model(
        hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    )
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for i, block in enumerate(ours.blocks):
            layer, attn = block.attn.qkv, theirs.base_model.model.model.layers[i].self_attn
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g))
            for j, (name, B) in enumerate(
                zip(("q", "v"), layer.lora_B.split([64, 32]), strict=True)
            ):
                peft_layer = getattr(attn, f"{name}_proj")
                peft_layer.lora_A["default"].weight.copy_(layer.lora_A[2 * j : 2 * j + 2])
                peft_layer.lora_B["default"].weight.copy_(B)
    idx = torch.randint(0, 65, (2, 12), generator=g)
    with torch.no_grad():
        expected = theirs(idx).logits
    assert (ours.eval()(idx)[0] - expected).abs().max() < 1e-4
