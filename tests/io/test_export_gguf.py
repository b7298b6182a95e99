"""`decoderlm export --format gguf`: the file read back by transformers (which reads GGUF with
llama.cpp's gguf-py), by decoderlm's own reader and, when llama-cpp-python is installed, by
llama.cpp itself."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from export_models import MIXED_TEXT, greedy, make_model_dir

from decoderlm.cli import main
from decoderlm.io.gguf import DIGEST_KEY, load_gguf

from conftest import one_line_error

transformers = pytest.importorskip("transformers")

# Largest logit error allowed, as a fraction of the largest |logit|, for each dtype, with
# the reason: f16 keeps 11 significant bits (a weight's rounding error <= 2^-12 of it), bf16 8
# (<= 2^-9), q8_0 rounds each weight to one of 255 steps of its 32-value block's largest |w|
# (error <= 1/254 of that); errors add up over the layers, hence a few times those.
# Measured on these models: f16 ~3e-4, bf16 ~3e-3, q8_0 ~6e-3 of the largest |logit|.
RELATIVE_TOLERANCE = {"f32": None, "f16": 2e-3, "bf16": 1.5e-2, "q8_0": 3e-2}


def _export(run, out, dtype="f32", *extra) -> int:
    return main(["export", "--run", str(run), "--format", "gguf", "--out", str(out),
                 "--outtype", dtype, *extra])  # fmt: skip


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
    model, _ = make_model_dir(tmp_path / "run", shape, "byte")  # a small vocabulary: fast
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
    assert back.config.activation == "gelu_tanh"  # llama.cpp's GPT-2 GELU
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
@pytest.mark.parametrize(
    ("shape", "kind"), [("gpt2", "gpt2"), ("llama", "gpt2"), ("gpt2", "char"), ("llama", "byte")]
)
def test_gguf_through_llama_cpp(tmp_path, shape, kind):
    """llama.cpp itself: the same token ids for a mixed text, the same greedy tokens, and
    next-token log-probabilities close (its GELU and matmuls round through f16 tables)."""
    from llama_cpp import Llama

    model, tok = make_model_dir(tmp_path / "run", shape, kind)
    out = tmp_path / f"{shape}.gguf"
    assert _export(tmp_path / "run", out) == 0
    llm = Llama(str(out), n_ctx=32, n_threads=1, logits_all=True, verbose=False)
    ids = tok.encode(MIXED_TEXT, allowed_special="all")
    assert llm.tokenize(MIXED_TEXT.encode(), add_bos=False, special=True) == ids
    assert llm.detokenize(ids, special=True).decode() == MIXED_TEXT
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


_LLAMA_CPP_Q8_0 = """
import json, sys
from llama_cpp import Llama
path, prompt = sys.argv[1], json.loads(sys.argv[2])
llm = Llama(path, n_ctx=32, n_threads=2, logits_all=True, verbose=False)
llm.eval(prompt)
print(json.dumps([float(x) for x in llm.scores[len(prompt) - 1]]))
"""


@pytest.mark.skipif(llama_cpp is None, reason="llama-cpp-python (llama_cpp) is not installed")
@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_gguf_q8_0_through_llama_cpp(tmp_path, shape):
    """llama.cpp's q8_0 kernels (int8 products, built for this CPU) give next-token
    log-probabilities close to decoderlm's reading of the same q8_0 file. They run in a child
    process at 2 threads, so that a build using instructions the CPU cannot run (SIGILL, see
    .ci/run on AMX) fails here with its signal instead of killing the test run."""
    import json
    import subprocess

    _, tok = make_model_dir(tmp_path / "run", shape, "byte")
    out = tmp_path / f"{shape}.gguf"
    assert _export(tmp_path / "run", out, "q8_0") == 0
    prompt = tok.encode(MIXED_TEXT, allowed_special="all")[:24]
    code = [sys.executable, "-c", _LLAMA_CPP_Q8_0, str(out), json.dumps(prompt)]
    done = subprocess.run(code, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"llama.cpp exited {done.returncode}: {done.stderr[-500:]}"
    theirs = torch.tensor(json.loads(done.stdout)).log_softmax(-1)
    with torch.no_grad():
        ours = load_gguf(out)[0](torch.tensor([prompt]))[0][0, -1].log_softmax(-1)
    # llama.cpp also rounds the activations to q8_0 blocks before each product: 0.011 (gpt2)
    # and 0.017 (llama) nats here; a wrong scale or layout is off by whole nats
    assert (theirs - ours).abs().max().item() < 0.05


@pytest.mark.parametrize(
    ("dropped", "words"),
    [
        ("blk.0.ffn_up.weight", "has no tensor blk.0.ffn_up.weight"),  # read for d_ff
        ("blk.0.ffn_down.weight", "missing ["),
    ],
)
def test_gguf_with_a_missing_tensor_is_refused_naming_it(tmp_path, capsys, dropped, words):
    """A GGUF file lacking a tensor is one line naming it (not a KeyError), and the line
    speaks of the file's metadata, not of a config.json the file does not have."""
    import gguf
    import numpy as np

    make_model_dir(tmp_path / "run", "gpt2", "byte")  # a small vocabulary: fast
    assert _export(tmp_path / "run", tmp_path / "m.gguf") == 0
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(tmp_path / "cut.gguf", "gpt2")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", DIGEST_KEY):
            continue  # the rewritten file's tensors differ: it records no digest
        writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    for tensor in reader.tensors:
        if tensor.name != dropped:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    capsys.readouterr()
    assert main(["sample", "--gguf", str(tmp_path / "cut.gguf"), "--prompt", "Hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json" not in err
    assert words in err


def test_damaged_gguf_is_refused_unless_told_not_to_verify(tmp_path, capsys):
    """One byte flipped in a GGUF export's tensor data (same size, still a valid GGUF file)
    stops `sample --gguf` with one line naming both digests; --no-verify loads it anyway."""
    make_model_dir(tmp_path / "run", "gpt2", "byte")  # a small vocabulary: fast
    path = tmp_path / "m.gguf"
    assert _export(tmp_path / "run", path) == 0
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor's data (tensor data ends the file)
    path.write_bytes(bytes(data))
    capsys.readouterr()
    argv = ["sample", "--gguf", str(path), "--prompt", "Hello", "--max-new-tokens", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("decoderlm: error:"), err
    assert "sha256" in err and "--no-verify" in err and str(path) in err
    assert main([*argv, "--no-verify"]) == 0
    with pytest.raises(ValueError, match="sha256"):
        load_gguf(path)
    load_gguf(path, verify=False)


@pytest.mark.parametrize("command", ["export", "sample"])
def test_without_the_gguf_package_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch,
                                                               command):  # fmt: skip
    """Where the [export] extra (the gguf package) is not installed, writing or reading a GGUF
    file says how to install it in one line instead of an ImportError traceback."""
    make_model_dir(tmp_path / "run", "gpt2", "byte")
    assert _export(tmp_path / "run", tmp_path / "m.gguf") == 0
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    if command == "export":
        argv = ["export", "--run", str(tmp_path / "run"), "--format", "gguf",
                "--out", str(tmp_path / "n.gguf")]  # fmt: skip
    else:
        argv = ["sample", "--gguf", str(tmp_path / "m.gguf"), "--prompt", "Hi"]
    capsys.readouterr()
    one_line_error(capsys, argv, "decoderlm[export]")
    assert not (tmp_path / "n.gguf").exists()
