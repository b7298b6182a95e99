"""Llama, Qwen2 and Mistral directories saved by transformers itself load with transformers'
logits and greedy tokens, their tokenizer gives transformers' ids, what decoderlm lacks is
refused in one line, and an export loads back in transformers with the same logits."""

from __future__ import annotations

import pytest
import torch
from hf_family import TEXT, edit_config, save_family, transformers_model

from decoderlm import load_model_and_tokenizer
from decoderlm.errors import UserError

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
CASES = {  # name: (family, save_family's keywords)
    "llama-gqa-rope-base": ("llama", dict(rope_theta=500000.0)),
    "llama-mqa-head-dim": ("llama", dict(num_key_value_heads=1, head_dim=16)),
    "llama3-scaling": ("llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-attention-bias": ("llama", dict(attention_bias=True)),
    "llama-mlp-bias": ("llama", dict(mlp_bias=True, num_key_value_heads=4)),
    "llama-sharded-bf16": ("llama", dict(dtype=torch.bfloat16, shard="20KB")),
    "llama-f16": ("llama", dict(dtype=torch.float16)),
    "qwen2": ("qwen2", dict(rope_theta=1000000.0)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "mistral": ("mistral", dict(sliding_window=64, head_dim=16)),
}
PROMPT = [5, 17, 42, 100, 3, 250, 7, 77, 123, 9, 60, 200]


def _greedy_transformers(model, prompt: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None  # run the n steps
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _greedy_ours(model, prompt: list[int], n: int) -> list[int]:
    from decoderlm import generate

    out = generate(model, torch.tensor([prompt]), n, temperature=0.0, ignore_eos=True)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_tokens_equal_transformers(tmp_path, name):
    family, fields = CASES[name]
    theirs = save_family(tmp_path, family, **fields)
    ours, _ = load_model_and_tokenizer(tmp_path)
    assert ours.config.n_kv_heads == theirs.config.num_key_value_heads
    assert next(ours.parameters()).dtype == torch.float32
    with torch.no_grad():
        expected = theirs(torch.tensor([PROMPT])).logits
        got = ours(torch.tensor([PROMPT]))[0]
    assert expected.std() > 1.0  # logits spread over several nats: a real comparison
    assert (got - expected).abs().max() < 1e-4
    assert _greedy_ours(ours, PROMPT, 12) == _greedy_transformers(theirs, PROMPT, 12)


def test_sharded_files_are_read_through_their_index(tmp_path):
    save_family(tmp_path, "llama", shard="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2


def test_tied_when_the_file_has_no_lm_head(tmp_path):
    """A file without lm_head.weight is tied whatever tie_word_embeddings says (Qwen2.5-0.5B's
    and SmolLM2's files hold the embedding only)."""
    theirs = save_family(tmp_path, "llama", tie_word_embeddings=True)
    edit_config(tmp_path, tie_word_embeddings=None)  # LlamaConfig's default: False
    ours, _ = load_model_and_tokenizer(tmp_path)
    assert ours.config.tie_embeddings
    with torch.no_grad():
        expected = theirs(torch.tensor([PROMPT])).logits
        assert (ours(torch.tensor([PROMPT]))[0] - expected).abs().max() < 1e-4


@pytest.mark.parametrize("kind_key", ["rope_type", "type"])
def test_transformers_4_rotary_spelling(tmp_path, kind_key):
    """rope_theta + rope_scaling (with "rope_type", or older files' "type"), no
    rope_parameters: the rotary settings transformers 4 wrote, read as transformers 5's."""
    theirs = save_family(tmp_path, "llama", rope_theta=500000.0, rope_scaling=LLAMA3)
    scaling = {kind_key: "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}
    edit_config(tmp_path, rope_parameters=None, rope_theta=500000.0, rope_scaling=scaling)
    ours, _ = load_model_and_tokenizer(tmp_path)
    assert (ours.config.rope_base, ours.config.rope_scaling) == (500000.0, LLAMA3)
    with torch.no_grad():
        expected = theirs(torch.tensor([PROMPT])).logits
        assert (ours(torch.tensor([PROMPT]))[0] - expected).abs().max() < 1e-4


def test_tokenizer_ids_equal_transformers(tmp_path):
    """Spaces, new lines, non-ASCII, emoji and special tokens: the same ids as
    AutoTokenizer, and the text back."""
    save_family(tmp_path, "qwen2")
    _, tokenizer = load_model_and_tokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    expected = theirs.encode(TEXT, add_special_tokens=False)
    assert tokenizer.encode(TEXT, allowed_special="all") == expected
    assert len(expected) > 20 and {0, 1, 2} <= set(expected)  # the special tokens matched
    assert tokenizer.decode(expected) == theirs.decode(expected) == TEXT


def test_generation_stops_at_every_end_of_text_id(tmp_path):
    """generation_config.json's eos_token_id list [0, 2]: a row ends at either id, as
    transformers' generate ends it."""
    from decoderlm import generate

    theirs = save_family(tmp_path, "llama")
    ours, tokenizer = load_model_and_tokenizer(tmp_path)
    assert tokenizer.eos_token_ids == (0, 2) and ours.eos_token_ids == (0, 2)
    for end in (0, 2):  # force the end id by making it the greedy choice after the prompt
        with torch.no_grad():
            ours.lm_head.weight[end] *= 0
            ours.lm_head.weight[end] += ours.lm_head.weight.sum(0)
            theirs.lm_head.weight.copy_(ours.lm_head.weight)
        out = generate(ours, torch.tensor([PROMPT]), 8, temperature=0.0)
        expected = theirs.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0
        )
        assert out[0].tolist() == expected[0].tolist()
        assert end in out[0, len(PROMPT) :].tolist()
        assert len(out[0]) < len(PROMPT) + 8


def test_mistral_sliding_window_caps_the_positions_with_a_note(tmp_path, capsys):
    theirs = save_family(tmp_path, "mistral", sliding_window=16)
    capsys.readouterr()  # transformers' progress bars
    ours, _ = load_model_and_tokenizer(tmp_path)
    err = capsys.readouterr().err
    assert ours.config.max_positions == 16
    assert err.count("\n") == 1 and "sliding window of 16 tokens" in err
    with torch.no_grad():  # within the window sliding-window attention is full attention
        expected = theirs(torch.tensor([PROMPT])).logits
        assert (ours(torch.tensor([PROMPT]))[0] - expected).abs().max() < 1e-4


REFUSALS = {
    "architecture": (
        dict(architectures=["PhiForCausalLM"], model_type="phi"),
        "PhiForCausalLM model; decoderlm runs LlamaForCausalLM, Qwen2ForCausalLM, "
        "MistralForCausalLM and GPT2LMHeadModel",
    ),
    "rope": (
        dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
        "rotary scaling 'yarn' is not one decoderlm has",
    ),
    "activation": (dict(hidden_act="gelu"), "options decoderlm has not: hidden_act='gelu'"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_what_decoderlm_lacks_is_refused_in_one_line(tmp_path, capsys, name):
    from decoderlm.cli import main

    changes, words = REFUSALS[name]
    save_family(tmp_path, "llama")
    edit_config(tmp_path, **changes)
    capsys.readouterr()  # transformers' progress bars
    with pytest.raises(UserError, match="decoderlm") as caught:
        load_model_and_tokenizer(tmp_path)
    assert words in str(caught.value) and "\n" not in str(caught.value)
    assert main(["sample", "--hf", str(tmp_path), "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and err.count("\n") == 0


def test_sample_command_continues_as_transformers(tmp_path, capsys):
    from decoderlm.cli import main

    theirs = save_family(tmp_path, "qwen2")
    capsys.readouterr()  # transformers' progress bars
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    prompt = "The capital of France"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    expected = tokenizer.decode(_greedy_transformers(theirs, ids, 10))
    args = ["sample", "--hf", str(tmp_path), "--prompt", prompt, "--max-new-tokens", "10"]
    assert main([*args, "--temperature", "0", "--ignore-eos"]) == 0
    assert prompt + expected in capsys.readouterr().out


@pytest.mark.parametrize(
    "name", ["llama-mqa-head-dim", "llama3-scaling", "qwen2", "qwen2-tied", "llama-tied"]
)
def test_export_loads_back_in_transformers_with_the_same_logits(tmp_path, name):
    """decoderlm export --format hf of a loaded Llama-family model: the architecture it was
    (Qwen2ForCausalLM for q/k/v biases), transformers' logits equal ours."""
    from decoderlm.io.hf import save_hf

    family, fields = CASES[name]
    save_family(tmp_path / "in", family, **fields)
    ours, tokenizer = load_model_and_tokenizer(tmp_path / "in")
    save_hf(ours, tokenizer, tmp_path / "out")
    back = transformers_model(tmp_path / "out")
    assert type(back).__name__ == {"qwen2": "Qwen2ForCausalLM"}.get(family, "LlamaForCausalLM")
    with torch.no_grad():
        expected = back(torch.tensor([PROMPT])).logits
        assert (ours(torch.tensor([PROMPT]))[0] - expected).abs().max() < 1e-4
    again, _ = load_model_and_tokenizer(tmp_path / "out")
    assert again.config == ours.config
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert fast.encode(TEXT, add_special_tokens=False) == tokenizer.encode(
        TEXT, allowed_special="all"
    )


def test_hf_exports_what_the_gguf_exporter_does_not_write_yet():
    from decoderlm.config import ModelConfig
    from decoderlm.io.targets import export_target
    from decoderlm.presets import PRESETS

    fields = dict(n_kv_heads=2, head_dim=8, qkv_bias=True, rope_scaling=dict(LLAMA3))
    config = ModelConfig(**{**PRESETS["llama-tiny"].model, **fields})
    assert export_target(config, "hf") == "llama"
    with pytest.raises(UserError, match="grouped-query attention .* not written by the"):
        export_target(config, "gguf")
