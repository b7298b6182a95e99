"""Interop with Hugging Face transformers' GPT-2, checked against transformers itself."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decoderlm import GPT2Tokenizer
from decoderlm.generation.generate import generate
from decoderlm.io.hf_gpt2 import load_gpt2, save_gpt2

from conftest import randomize, tiny_model

transformers = pytest.importorskip("transformers")

SHARED_BPE = Path(__file__).resolve().parents[3] / "shared" / "data" / "gpt2-bpe"
BPE_DIR = Path(__import__("decoderlm.tokenizers").tokenizers.__file__).parent / "bpe"


def hf_model(tie=True, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=101,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=4,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(
                    torch.randn_like(p) * 0.2 + (1.0 if "ln" in name and "weight" in name else 0.0)
                )
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_a_transformers_gpt2_loads_with_the_same_logits(tmp_path, tie):
    ref = hf_model(tie)
    ref.save_pretrained(tmp_path)
    model = load_gpt2(tmp_path)
    assert model.config.activation == "gelu_tanh"  # GPT-2 was trained with the tanh GELU
    idx = torch.randint(0, 101, (2, 32))
    with torch.no_grad():
        expected = ref(idx).logits
    assert (model(idx)[0] - expected).abs().max() < 1e-4


def test_old_layout_with_mask_buffers_and_a_bin_file(tmp_path):
    # the layout of older GPT-2 checkpoints: no "transformer." prefix, the causal-mask buffers
    # attn.bias / attn.masked_bias (ignored on load), pytorch_model.bin read with
    # weights_only=True
    ref = hf_model()
    ref.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    old = {k.removeprefix("transformer."): v for k, v in state.items()}
    for i in range(2):
        old[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
        old[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(old, tmp_path / "pytorch_model.bin")
    idx = torch.randint(0, 101, (1, 32))
    with torch.no_grad():
        expected = ref(idx).logits
    assert (load_gpt2(tmp_path)(idx)[0] - expected).abs().max() < 1e-4
    del old["h.1.mlp.c_fc.weight"]
    torch.save(old, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"missing \['blocks.1.mlp.fc.weight'\]"):
        load_gpt2(tmp_path)


@pytest.mark.parametrize("tie", [True, False])
def test_an_exported_model_loads_in_transformers_with_the_same_logits(tmp_path, tie):
    model = randomize(tiny_model(tie_embeddings=tie, activation="gelu_tanh"), seed=2)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    save_gpt2(model, tmp_path)
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 65, (2, 32))
    with torch.no_grad():
        assert (ref(idx).logits - model(idx)[0]).abs().max() < 1e-4
    assert torch.equal(load_gpt2(tmp_path)(idx)[0], model(idx)[0])
    with pytest.raises(ValueError, match="only GPT-2-shaped"):
        save_gpt2(tiny_model(pos_encoding="rope"), tmp_path / "rope")


def test_gpt2_tokenizer_matches_transformers_on_wikitext_with_unicode():
    tok = GPT2Tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257
    assert tok.encode("<|endoftext|>", allowed_special="all") == [50256]  # tiktoken's rule
    from decoderlm.data.corpus import EMBEDDED_CORPUS

    text = EMBEDDED_CORPUS.read_text(encoding="utf-8")
    start = text.index("Senjō") if "Senjō" in text else text.index("é") - 2000
    paragraph = text[start - 1500 : start + 1500]
    assert any(ord(c) > 127 for c in paragraph)
    files = SHARED_BPE if SHARED_BPE.is_dir() else BPE_DIR
    hf = None  # transformers 5 names the files vocab / merges, 4.x vocab_file / merges_file
    for names in (("vocab", "merges"), ("vocab_file", "merges_file")):
        try:
            hf = transformers.GPT2TokenizerFast(
                **{names[0]: str(files / "encoder.json"), names[1]: str(files / "vocab.bpe")}
            )
        except (TypeError, ValueError):
            continue
        if len(hf) == 50257:
            break
    assert hf is not None and len(hf) == 50257
    ids = tok.encode(paragraph)
    assert ids == hf(paragraph)["input_ids"]
    assert tok.decode(ids) == paragraph
    # Hugging Face turns the special token's string into its id, as allowed_special="all"
    mixed = paragraph[:200] + "<|endoftext|>" + paragraph[200:400]
    assert hf(mixed)["input_ids"] == tok.encode(mixed, allowed_special="all")


def test_sample_command_reads_a_transformers_checkpoint(tmp_path, capsys):
    from decoderlm.cli import main

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    args = [
        "sample",
        "--hf",
        str(tmp_path),
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "8",
        "--seed",
        "4",
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.strip()
    assert main(["sample", "--hf", str(tmp_path / "missing")]) == 2
    assert "config.json not found" in capsys.readouterr().err


def test_gpt2_tokenizer_saves_and_a_char_model_refuses_it(tmp_path, capsys):
    # a 65-character model and the 50,257-token BPE do not fit together: refused, not paired
    from decoderlm import load_tokenizer
    from decoderlm.cli import main

    GPT2Tokenizer().save_pretrained(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), GPT2Tokenizer)
    assert GPT2Tokenizer.from_pretrained(tmp_path).encode(" Hello") == [18435]
    tiny_model().save_pretrained(tmp_path)
    assert main(["sample", "--run", str(tmp_path), "--prompt", "a"]) == 2
    assert "50257 tokens but the model expects vocab_size=65" in capsys.readouterr().err


def test_damaged_or_foreign_gpt2_directories_give_clear_errors(tmp_path):
    good = tmp_path / "good"
    hf_model().save_pretrained(good)
    config = json.loads((good / "config.json").read_text())
    weights = (good / "model.safetensors").read_bytes()

    def variant(name, config_data=config, weight_bytes=weights):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config_data))
        if weight_bytes is not None:
            (d / "model.safetensors").write_bytes(weight_bytes)
        return d

    cases = [
        (
            variant("trunc", weight_bytes=weights[: len(weights) // 2]),
            ValueError,
            "not a readable safetensors file",
        ),
        (variant("list", [1]), ValueError, "not a GPT-2 config"),
        (variant("nokeys", {"model_type": "gpt2"}), ValueError, "lacks the GPT-2 fields"),
        (variant("llama", {**config, "model_type": "llama"}), ValueError, "model_type 'llama'"),
        (
            variant("cross", {**config, "add_cross_attention": True}),
            ValueError,
            r"unsupported GPT-2 options: add_cross_attention=True$",
        ),
        (variant("fewer", {**config, "n_layer": 1}), ValueError, r"unexpected \['blocks.1"),
        (variant("nullpdrop", {**config, "resid_pdrop": None}), None, None),
        (variant("noweights", weight_bytes=None), FileNotFoundError, "no model.safetensors"),
    ]
    bad_bin = variant("badbin", weight_bytes=None)
    (bad_bin / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    cases.append((bad_bin, ValueError, "could not be read as plain tensors"))
    for directory, error, match in cases:
        if error is None:
            load_gpt2(directory)
            continue
        with pytest.raises(error, match=match):
            load_gpt2(directory)


def test_save_gpt2_unwraps_compiled_models(tmp_path):
    model = tiny_model()
    save_gpt2(torch.compile(model), tmp_path)
    idx = torch.randint(0, 65, (1, 8))
    assert torch.equal(load_gpt2(tmp_path)(idx)[0], model(idx)[0])


def test_gpt2_import_refuses_different_tied_matrices_and_loads_them_untied(tmp_path):
    ref = hf_model(tie=False)
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["tie_word_embeddings"] = True  # a file whose two matrices differ, said to be tied
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = load_file(tmp_path / "model.safetensors")
    wte, head = state["transformer.wte.weight"], state["lm_head.weight"]
    difference = (wte.double() - head.double()).abs().max().item()
    with pytest.raises(ValueError) as error:
        load_gpt2(tmp_path)
    message = str(error.value)
    for fragment in ("transformer.wte.weight", "lm_head.weight", "tie_embeddings=False"):
        assert fragment in message, message
    assert f"max abs difference {difference:.6g}" in message
    idx = torch.randint(0, 101, (2, 32))
    with torch.no_grad():
        expected = ref(idx).logits
    assert (load_gpt2(tmp_path, tie_embeddings=False)(idx)[0] - expected).abs().max() < 1e-4
    state["lm_head.weight"] = wte.clone()  # both present and equal: fine, and tied
    save_file(state, tmp_path / "model.safetensors")
    model = load_gpt2(tmp_path)
    assert model.lm_head.weight is model.tok_emb.weight


def test_a_padded_model_samples_and_exports_to_transformers(tmp_path):
    # nanoGPT's padding: GPT-2's 50,257 tokens in 50,304 rows
    model = randomize(
        tiny_model(
            vocab_size=50257,
            padded_vocab_size=50304,
            d_model=16,
            n_heads=2,
            n_layers=1,
            block_size=16,
            activation="gelu_tanh",
        ),
        seed=3,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
        model.tok_emb.weight[50257:] = 3.0  # would dominate every softmax if it had logits
    idx = torch.randint(0, 50257, (2, 16))
    assert int(generate(model, idx[:, :3], 30, temperature=1.5, seed=0).max()) < 50257
    save_gpt2(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == 50257 and config["eos_token_id"] == 50256
    assert load_file(tmp_path / "model.safetensors")["transformer.wte.weight"].shape == (50257, 16)
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert (ref(idx).logits - model(idx)[0]).abs().max() < 1e-4
    padded = load_gpt2(tmp_path, padded_vocab_size=50304)
    assert padded.config.padded_vocab_size == 50304 and padded.tok_emb.weight.shape[0] == 50304
    assert torch.equal(padded(idx)[0], load_gpt2(tmp_path)(idx)[0])


def test_a_file_with_padded_rows_imports_with_its_real_vocabulary(tmp_path):
    ref = hf_model()  # 101 rows, of which 90 are tokens
    ref.save_pretrained(tmp_path)
    model = load_gpt2(tmp_path, vocab_size=90)
    assert model.config.vocab_size == 90 and model.config.padded_vocab_size == 101
    idx = torch.randint(0, 90, (2, 32))
    with torch.no_grad():
        expected = ref(idx).logits[..., :90]
    assert (model(idx)[0] - expected).abs().max() < 1e-4
    with pytest.raises(ValueError, match="from 1 to the file's 101 rows"):
        load_gpt2(tmp_path, vocab_size=102)
    with pytest.raises(ValueError, match=r"padded_vocab_size \(80\) must be >= vocab_size"):
        load_gpt2(tmp_path, padded_vocab_size=80)


def test_save_gpt2_writes_special_token_ids_only_when_the_vocabulary_has_them(tmp_path):
    model = tiny_model(activation="gelu_tanh")  # 65 ids: GPT-2's 50256 is not one of them
    save_gpt2(model, tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "plain")
    assert hf.config.eos_token_id is None and hf.config.bos_token_id is None
    save_gpt2(model, tmp_path / "eos", eos_token_id=64)
    config = json.loads((tmp_path / "eos" / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == 64
    with pytest.raises(ValueError, match=r"eos_token_id 65 is not in the vocabulary \[0, 65\)"):
        save_gpt2(model, tmp_path / "bad", eos_token_id=65)


def test_a_cropped_gpt2_gives_the_first_positions_of_the_full_one(tmp_path):
    # nanoGPT's crop_block_size, on a transformers GPT-2 with random weights
    ref = hf_model()
    ref.save_pretrained(tmp_path / "hf")
    model = load_gpt2(tmp_path / "hf").crop_block_size(8)
    assert model.config.block_size == 8 and model.pos_emb.weight.shape == (8, 64)
    idx = torch.randint(0, 101, (2, 32))
    with torch.no_grad():
        full = ref(idx).logits
    assert (model(idx[:, :8])[0] - full[:, :8]).abs().max() < 1e-4
    assert (model(idx[:, :3])[0] - full[:, :3]).abs().max() < 1e-4
    with pytest.raises(ValueError, match="block_size=8"):
        model(idx[:, :9])
    save_gpt2(model, tmp_path / "cropped")
    cropped_ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "cropped").eval()
    assert cropped_ref.config.n_positions == 8
    with torch.no_grad():
        assert (cropped_ref(idx[:, :8]).logits - full[:, :8]).abs().max() < 1e-4
