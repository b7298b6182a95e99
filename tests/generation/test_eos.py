"""Generation stops at the vocabulary's end-of-text token by default: generate(), stream_text
and `decoderlm sample`; ignore_eos / --ignore-eos runs on."""

import pytest
import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cli import main
from decoderlm.generation.generate import generate, stream_generate, stream_text
from decoderlm.generation.params import SamplingParams
from decoderlm.io.hf_gpt2 import load_gpt2, save_gpt2
from decoderlm.tokenizers import ByteTokenizer, CharTokenizer
from decoderlm.tokenizers.base import END_OF_TEXT

from conftest import tiny_model


def always_eos(directory, eos: int = 50256) -> None:
    """A GPT-2-BPE-sized model whose greedy choice is always `eos`, saved as a transformers
    GPT-2 directory: untied, ln_f gives ones, and only the unembedding row of `eos` is set."""
    config = ModelConfig(
        vocab_size=50257, block_size=16, n_layers=1, n_heads=2, d_model=8, tie_embeddings=False
    )
    torch.manual_seed(0)
    model = DecoderLM(config).eval()
    with torch.no_grad():
        model.ln_f.weight.zero_()
        model.ln_f.bias.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[eos] = 10.0  # logit 80 against 0: sampling picks it too
    save_gpt2(model, directory)


def test_a_loaded_gpt2_model_stops_at_50256_by_default(tmp_path):
    always_eos(tmp_path)
    model = load_gpt2(tmp_path)
    assert model.eos_token_id == 50256
    prompt = torch.tensor([[464, 2068]])
    out = generate(model, prompt, 5)  # sampling at temperature 1
    assert out.tolist() == [[464, 2068, 50256]]  # the end-of-text token is kept, as a stop id
    assert generate(model, prompt, 5, ignore_eos=True).size(1) == 2 + 5
    assert generate(model, prompt, 5, eos_token_id=7).size(1) == 2 + 5  # another id: runs on
    assert (
        list(stream_generate(model, prompt, SamplingParams(5, ignore_eos=True)))[-1].item() == 50256
    )


def test_an_explicit_eos_id_ends_each_row_and_pads_the_rest():
    model = tiny_model()  # built from a config: no end-of-text id, so it runs on
    assert model.eos_token_id is None
    prompt = torch.randint(0, 65, (2, 3), generator=torch.Generator().manual_seed(0))
    free = generate(model, prompt, 20, do_sample=False)
    assert free.size(1) == 23
    eos = free[0, 3 + 3].item()
    out = generate(model, prompt, 20, do_sample=False, eos_token_id=eos, pad_token_id=-5)
    row0 = out[0, 3:].tolist()
    k = row0.index(eos)
    assert row0[: k + 1] == free[0, 3 : 4 + k].tolist() and set(row0[k + 1 :]) <= {-5}
    model.eos_token_id = eos  # what the loaders set
    assert torch.equal(generate(model, prompt, 20, do_sample=False, pad_token_id=-5), out)
    assert torch.equal(generate(model, prompt, 20, do_sample=False, ignore_eos=True), free)
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        generate(model, prompt, 2, eos_token_id="50256")


def test_stream_text_stops_at_eos_without_its_text_and_keeps_stop_texts():
    chars = list("abcdefghij")
    tok = CharTokenizer(chars, special_tokens=[END_OF_TEXT])
    model = tiny_model(vocab_size=tok.vocab_size)
    model.eos_token_id = tok.eot_token
    free = generate(model, torch.tensor([[0]]), 12, do_sample=False, ignore_eos=True)
    ids = free[0, 1:].tolist()
    text = "".join(tok.decode([i]) for i in ids)
    pieces = list(stream_text(model, tok, [0], SamplingParams(12, 0, ignore_eos=True)))
    assert "".join(p[0] for p in pieces) == text and pieces[-1][1] == "length"
    # an id the model picks at step 3 as its end of text: stops there, text before it only
    model.eos_token_id = ids[2]
    pieces = list(stream_text(model, tok, [0], SamplingParams(12, 0)))
    first = ids.index(ids[2])
    assert "".join(p[0] for p in pieces) == tok.decode(ids[:first])
    assert pieces[-1][1:] == ("stop", first + 1)
    # a stop text spanning two tokens still ends the text before it
    model.eos_token_id = None
    span = tok.decode(ids[4:6])
    cut = text.find(span)
    pieces = list(stream_text(model, tok, [0], SamplingParams(12, 0, stop=[span])))
    assert "".join(p[0] for p in pieces) == text[:cut] and pieces[-1][1] == "stop"


def test_sample_ends_at_eos_unless_ignore_eos(tmp_path, capsys):
    always_eos(tmp_path)
    argv = ["sample", "--hf", str(tmp_path), "--prompt", "Hi", "--max-new-tokens", "4"]
    assert main([*argv, "--seed", "0"]) == 0
    assert capsys.readouterr().out == "Hi\n"  # stopped at once; the token's text not printed
    assert main([*argv, "--seed", "0", "--ignore-eos"]) == 0
    assert capsys.readouterr().out == "Hi" + "<|endoftext|>" * 4 + "\n"


def test_a_run_without_an_end_of_text_token_runs_on(tmp_path):
    model = tiny_model(vocab_size=256)
    model.save_pretrained(tmp_path)
    ByteTokenizer().save_pretrained(tmp_path)
    loaded = DecoderLM.from_pretrained(tmp_path)
    assert loaded.eos_token_id is None
    assert generate(loaded, torch.tensor([[97]]), 6).size(1) == 7
