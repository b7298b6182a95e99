import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from decoderlm import DecoderLM
from decoderlm.model.weights import load_state, normalize_state_dict, save_model

from conftest import randomize, tiny_model, write_weights_by_hand


@pytest.mark.parametrize("tied", [True, False])
def test_save_then_load_gives_identical_logits(tmp_path, tied):
    model = randomize(tiny_model(tie_embeddings=tied))
    model.save_pretrained(tmp_path, {"train": {"lr": 0.1}})
    again = DecoderLM.from_pretrained(tmp_path)
    idx = torch.randint(0, 65, (2, 32))
    assert torch.equal(model(idx)[0], again(idx)[0])
    assert again.config == model.config and not again.training
    assert (again.lm_head.weight is again.tok_emb.weight) == tied
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model"]["d_model"] == 64 and config["train"] == {"lr": 0.1}
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in keys) == (not tied)


def write_both_matrices(model: DecoderLM, directory, head: torch.Tensor) -> None:
    """Save `model` (tied) with an explicit lm_head.weight = head beside tok_emb.weight."""
    model.save_pretrained(directory)
    state = load_file(directory / "model.safetensors")
    state["lm_head.weight"] = head.contiguous()
    write_weights_by_hand(state, directory)


def test_a_tied_model_refuses_two_different_matrices_and_loads_them_untied(tmp_path):
    model = randomize(tiny_model())
    head = model.tok_emb.weight.detach().clone()
    head[3, 5] += 0.25
    head[7, 1] -= 0.5
    write_both_matrices(model, tmp_path, head)
    with pytest.raises(ValueError) as error:
        DecoderLM.from_pretrained(tmp_path)
    message = str(error.value)
    for fragment in ("tok_emb.weight", "lm_head.weight", "max abs difference 0.5"):
        assert fragment in message, message
    assert "tie_embeddings=False" in message
    untied = DecoderLM.from_pretrained(tmp_path, tie_embeddings=False)
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert torch.equal(untied.lm_head.weight, head)
    idx = torch.randint(0, 65, (2, 32))
    reference = randomize(tiny_model(tie_embeddings=False))  # the same values, untied
    with torch.no_grad():
        reference.lm_head.weight.copy_(head)
    assert torch.equal(untied(idx)[0], reference(idx)[0])
    # equal bitwise: one Parameter
    write_both_matrices(model, tmp_path, model.tok_emb.weight.detach().clone())
    again = DecoderLM.from_pretrained(tmp_path)
    assert again.lm_head.weight is again.tok_emb.weight
    assert torch.equal(again(idx)[0], model(idx)[0])


def test_one_matrix_stands_for_both_tied_or_untied(tmp_path):
    model = randomize(tiny_model())
    idx = torch.randint(0, 65, (2, 32))
    model.save_pretrained(tmp_path)  # tok_emb.weight alone
    untied = DecoderLM.from_pretrained(tmp_path, tie_embeddings=False)
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert torch.equal(untied(idx)[0], model(idx)[0])
    state = load_file(tmp_path / "model.safetensors")
    state["lm_head.weight"] = state.pop("tok_emb.weight")  # the unembedding alone
    write_weights_by_hand(state, tmp_path)
    assert torch.equal(DecoderLM.from_pretrained(tmp_path)(idx)[0], model(idx)[0])
    untied_config = json.loads((tmp_path / "config.json").read_text())
    untied_config["model"]["tie_embeddings"] = False  # an untied model's file, one matrix
    (tmp_path / "config.json").write_text(json.dumps(untied_config))
    untied = DecoderLM.from_pretrained(tmp_path)
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert torch.equal(untied(idx)[0], model(idx)[0])


def test_tied_weights_stay_one_parameter_after_to_and_load_state_dict(tmp_path):
    model = randomize(tiny_model())
    model.save_pretrained(tmp_path)
    loaded = DecoderLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.tok_emb.weight
    half = loaded.to(torch.bfloat16)
    assert half.lm_head.weight is half.tok_emb.weight
    assert half.lm_head.weight.dtype == torch.bfloat16
    fresh = tiny_model(seed=5)
    fresh.load_state_dict(model.state_dict())
    assert fresh.lm_head.weight is fresh.tok_emb.weight
    assert torch.equal(fresh.lm_head.weight, model.tok_emb.weight)
    only_embedding = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tiny_model(seed=6).load_state_dict(only_embedding)  # strict: the one matrix is enough
    conflicting = dict(model.state_dict())
    conflicting["lm_head.weight"] = conflicting["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match=r"max abs difference 1\).*tie_embeddings=False"):
        copy.deepcopy(fresh).load_state_dict(conflicting)


def test_max_positions_is_saved_and_a_config_json_without_it_still_loads(tmp_path):
    model = tiny_model(block_size=16, max_positions=48, pos_encoding="rope")
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model"]["max_positions"] == 48
    assert DecoderLM.from_pretrained(tmp_path).config.max_positions == 48
    tiny_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["model"]["max_positions"]  # a config.json without them loads with defaults
    del config["model"]["padded_vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert DecoderLM.from_pretrained(tmp_path).config.max_positions == 32  # block_size


def test_compiled_and_ddp_style_prefixes_are_stripped(tmp_path):
    # torch.compile and DDP wrap the model and prefix every parameter name (_orig_mod.,
    # module.): saved files hold none of them, prefixed files load with the same logits, and
    # a key with _orig_mod only in its middle is left alone
    model = randomize(tiny_model())
    compiled = torch.compile(model)  # lazy: nothing is compiled until it is called
    save_model(compiled, tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert not any(k.startswith(("_orig_mod", "module")) for k in saved)
    idx = torch.randint(0, 65, (1, 32))
    reference = model(idx)[0]
    assert torch.equal(DecoderLM.from_pretrained(tmp_path)(idx)[0], reference)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for prefix in ("module.", "_orig_mod.", "module._orig_mod."):
        write_weights_by_hand({prefix + k: v for k, v in state.items()}, tmp_path)
        assert torch.equal(DecoderLM.from_pretrained(tmp_path)(idx)[0], reference)
    assert normalize_state_dict({"blocks._orig_mod.x": 1}) == {"blocks._orig_mod.x": 1}


def test_mismatched_weights_are_reported(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["extra.weight"] = state.pop("ln_f.weight")
    write_weights_by_hand(state, tmp_path)
    with pytest.raises(
        ValueError, match=r"missing \['ln_f.weight'\], unexpected \['extra.weight'\]"
    ):
        DecoderLM.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError):
        DecoderLM.from_pretrained(tmp_path / "nope")


def test_a_config_that_does_not_match_the_weights_is_refused_before_building(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model"]["n_layers"] = 10**6  # building this would exhaust memory
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do not belong together"):
        DecoderLM.from_pretrained(tmp_path)


def test_an_unfilled_model_takes_the_tensors_read_as_its_weights():
    # DecoderLM.unfilled allocates no parameter; load_state makes the read tensors the
    # parameters: float32 ones the loader owns as they are (no copy), others converted, a
    # tensor that is part of a larger one given storage of its own; the tie survives and the
    # logits are the model's. Tensors not owned (a file's mapping) are copied once.
    model = randomize(tiny_model(pos_encoding="rope"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["blocks.0.mlp.proj.weight"] = state["blocks.0.mlp.proj.weight"].bfloat16()
    fused = torch.cat([state["blocks.1.attn.proj.weight"], torch.zeros(3, 64)])
    state["blocks.1.attn.proj.weight"] = fused[:64]
    unfilled = DecoderLM.unfilled(model.config)
    assert all(p.is_meta for p in unfilled.parameters())
    assert not unfilled.rope_cos.is_meta and torch.equal(unfilled.rope_cos, model.rope_cos)
    loaded = load_state(unfilled, state, "the test's state", owned=True).eval()
    qkv = loaded.blocks[0].attn.qkv.weight
    assert qkv.data_ptr() == state["blocks.0.attn.qkv.weight"].data_ptr()
    copied = load_state(DecoderLM.unfilled(model.config), state, "the test's state")
    copy_of_qkv = copied.blocks[0].attn.qkv.weight
    assert copy_of_qkv.data_ptr() != qkv.data_ptr() and torch.equal(copy_of_qkv, qkv)
    assert copied.lm_head.weight is copied.tok_emb.weight
    down = loaded.blocks[0].mlp.proj.weight
    assert down.dtype == torch.float32
    assert torch.equal(down, state["blocks.0.mlp.proj.weight"].float())
    proj = loaded.blocks[1].attn.proj.weight
    assert proj.untyped_storage().nbytes() == proj.numel() * 4 and torch.equal(proj, fused[:64])
    assert loaded.lm_head.weight is loaded.tok_emb.weight
    assert loaded.num_parameters() == model.num_parameters()
    model.blocks[0].mlp.proj.weight.data = state["blocks.0.mlp.proj.weight"].float()
    idx = torch.randint(0, 65, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(idx)[0], model.eval()(idx)[0])
