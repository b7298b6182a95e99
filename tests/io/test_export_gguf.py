"""`decoderlm export --format gguf`: the file read back by transformers (which reads GGUF with
llama.cpp's gguf-py), by decoderlm's own reader and, when llama-cpp-python is installed, by
llama.cpp itself."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from export_models import MIXED_TEXT, greedy, make_model_dir

from decoderlm.cli import main
from decoderlm.io.gguf import load_gguf

transformers = pytest.importorskip("transformers")

# Largest logit error allowed, as a fraction of the largest |logit|, for each dtype, with
# the reason: f16 keeps 11 significant bits (a weight's rounding error <= 2^-12 of it), bf16 8
# (<= 2^-9), q8_0 rounds each weight to one of 255 steps of its 32-value block's largest |w|
# (error <= 1/254 of that); errors add up over the layers, hence a few times those.
# Measured on these models: f16 ~3e-4, bf16 ~3e-3, q8_0 ~6e-3 of the largest |logit|.
RELATIVE_TOLERANCE = {"f32": None, "f16": 2e-3, "bf16": 1.5e-2, "q8_0": 3e-2}


def _export(run, out, dtype="f32", *extra) -> int:
    return main(["export", "--run", str(run), "--format", "gguf", "--out", str(out),
                 "--dtype", dtype, *extra])  # fmt: skip


def _hf_from_gguf(path):
    """transformers' model of a GGUF file. Its GPT-2 config takes the position table's size
    from n_positions (default 1024), not from the file's context_length, so a GPT-2 file with
    another context needs n_positions given."""
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if path.name.startswith("gpt2"):
        kwargs["n_positions"] = 32
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs).eval()


@pytest.mark.parametrize("shape", ["gpt2", "llama", "llama-tied"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_gguf_logits_through_transformers(tmp_path, shape, dtype):
    model, _ = make_model_dir(tmp_path / "run", shape)
    out = tmp_path / f"{shape.split('-')[0]}-{dtype}.gguf"
    assert _export(tmp_path / "run", out, dtype) == 0
    ids = torch.randint(
        0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        ref = model(ids)[0]
        theirs = _hf_from_gguf(out)(ids).logits
        ours = load_gguf(out)[0](ids)[0]
    err = (theirs - ref).abs().max().item()
    if dtype == "f32":
        assert err <= 1e-4
        assert (ours - ref).abs().max().item() == 0.0  # f32 round trip is exact
    else:
        scale = ref.abs().max().item()
        assert err <= RELATIVE_TOLERANCE[dtype] * scale, (err, scale)
        assert (ours - theirs).abs().max().item() <= 1e-4  # the same dequantised weights


def test_gguf_gpt2_tokenizer_through_transformers(tmp_path):
    from transformers import AutoTokenizer

    _, tok = make_model_dir(tmp_path / "run", "gpt2", "gpt2")
    out = tmp_path / "gpt2.gguf"
    assert _export(tmp_path / "run", out) == 0
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    assert theirs.encode(MIXED_TEXT) == tok.encode(MIXED_TEXT, allowed_special="all")
    assert type(load_gguf(out)[1]).__name__ == "GPT2Tokenizer"


@pytest.mark.parametrize("kind", ["char", "byte"])
def test_gguf_char_and_byte_round_trip(tmp_path, kind):
    """A char or byte vocabulary goes into the file (llama.cpp's byte-level BPE form, plus
    decoderlm's description), and decoderlm's reader gives back the same tokenizer."""
    model, tok = make_model_dir(tmp_path / "run", "gpt2", kind)
    out = tmp_path / "gpt2.gguf"
    assert _export(tmp_path / "run", out) == 0
    back, back_tok = load_gguf(out)
    assert back_tok.to_dict() == tok.to_dict()
    ids = torch.tensor([tok.encode(MIXED_TEXT, allowed_special="all")[:32]])
    assert torch.equal(back(ids)[0], model(ids)[0])


def test_gguf_q8_0_refuses_rows_not_multiple_of_32(tmp_path, capsys):
    make_model_dir(tmp_path / "run", "gpt2", d_model=48, n_heads=2)
    assert _export(tmp_path / "run", tmp_path / "m.gguf", "q8_0") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "q8_0" in err and "d_model=48" in err
    assert not (tmp_path / "m.gguf").exists()


def test_gguf_refuses_exact_gelu_gpt2(tmp_path, capsys):
    """llama.cpp's GPT-2 has the tanh GELU only: an exact-GELU model is refused for gguf."""
    make_model_dir(tmp_path / "run", "gpt2-untied-exact")
    assert _export(tmp_path / "run", tmp_path / "m.gguf") == 2
    err = capsys.readouterr().err.strip()
    assert "--activation gelu_tanh" in err and err.count("\n") == 0


llama_cpp = importlib.util.find_spec("llama_cpp")


@pytest.mark.skipif(llama_cpp is None, reason="llama-cpp-python (llama_cpp) is not installed")
@pytest.mark.parametrize(("shape", "kind"), [("gpt2", "gpt2"), ("llama", "gpt2"), ("gpt2", "char")])
def test_gguf_through_llama_cpp(tmp_path, shape, kind):
    """llama.cpp itself: the same token ids for a mixed text, the same greedy tokens, and
    next-token log-probabilities close (its GELU and matmuls round through f16 tables)."""
    from llama_cpp import Llama

    model, tok = make_model_dir(tmp_path / "run", shape, kind)
    out = tmp_path / f"{shape}.gguf"
    assert _export(tmp_path / "run", out) == 0
    llm = Llama(str(out), n_ctx=32, n_threads=1, logits_all=True, verbose=False)
    text = MIXED_TEXT if kind == "gpt2" else MIXED_TEXT.replace("日本語", "")
    ids = tok.encode(text, allowed_special="all")
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
    prompt = ids[:8]
    want = greedy(model, prompt, 12)
    got = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        got.append(token)
        if len(got) == 12:
            break
    assert got == want
    llm.reset()
    llm.eval(prompt)
    theirs = torch.tensor(llm.scores[len(prompt) - 1]).log_softmax(-1)
    with torch.no_grad():
        ours = model(torch.tensor([prompt]))[0][0, -1].log_softmax(-1)
    assert (theirs - ours).abs().max().item() < 1e-2
