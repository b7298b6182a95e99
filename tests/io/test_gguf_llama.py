"""GGUF files of the Llama family (llama.cpp "llama" and "qwen2"): files written by llama.cpp's
converter's conventions read against transformers, quantised tensors against gguf-py,
SmolLM2-135M-Instruct's real file against transformers' own GGUF reader, decoderlm's exports of
grouped-query, Qwen2 and Llama 3-scaled models against transformers and llama.cpp, and
truncated or edited files refused."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from export_models import MIXED_TEXT, greedy, make_model_dir

from decoderlm.cli import main
from decoderlm.io.gguf import DIGEST_KEY, TOKENIZER_KEY, _read, gguf_vocab, load_gguf
from decoderlm.tokenizers import ByteTokenizer

from conftest import SMOLLM2_GGUF, needs_smollm2, one_line_error

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
llama_cpp = importlib.util.find_spec("llama_cpp")
needs_llama_cpp = pytest.mark.skipif(
    llama_cpp is None, reason="llama-cpp-python (llama_cpp) is not installed"
)
# with head_dim 16 and rope base 1e4, two of the eight frequencies lie between the bounds
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=2048)  # fmt: skip


def converter_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` (q: n_head, k: n_head_kv), written
    out here: rows of each head reordered from the half-split rotary pairing to adjacent pairs."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def converter_rope_factors(head_dim: int, base: float, s: dict) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for Llama 3's rope_scaling."""
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _theta(scaling: dict | None) -> float:
    return 5e5 if scaling is None else 1e4


def _hf_model(family: str, tied: bool, scaling: dict | None):
    """A random tiny transformers Llama or Qwen2 (GQA: 4 query heads, 2 key/value heads of
    16 features)."""
    torch.manual_seed(0)
    kwargs = dict(vocab_size=257, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, rope_theta=_theta(scaling),
                  tie_word_embeddings=tied)  # fmt: skip
    if scaling is not None:
        kwargs["rope_scaling"] = dict(scaling)
    cls = transformers.Qwen2ForCausalLM if family == "qwen2" else transformers.LlamaForCausalLM
    config_cls = transformers.Qwen2Config if family == "qwen2" else transformers.LlamaConfig
    model = cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # logits spread over several nats
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5)
    return model


def _write_converter_file(model, family: str, path, scaling=None, **meta_overrides):
    """A GGUF file of a transformers Llama/Qwen2 laid out as llama.cpp's converter writes it."""
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(path, family)
    keys = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
            "feed_forward_length": c.intermediate_size, "block_count": c.num_hidden_layers,
            "attention.head_count": c.num_attention_heads,
            "attention.head_count_kv": c.num_key_value_heads,
            "rope.dimension_count": head_dim}  # fmt: skip
    keys.update(meta_overrides)
    for key, value in keys.items():
        w.add_uint32(f"{family}.{key}", value)
    w.add_float32(f"{family}.rope.freq_base", _theta(scaling))
    w.add_float32(f"{family}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    tokens, types, merges = gguf_vocab(ByteTokenizer(["<|endoftext|>"]))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_string(TOKENIZER_KEY, json.dumps(ByteTokenizer(["<|endoftext|>"]).to_dict()))
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    for key, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        elif key == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            name = "output.weight"
        else:
            parts = key.split(".")  # model.layers.i.<module>.<weight|bias>
            name = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
            if family == "llama" and "attn_q" in name:
                array = converter_permute(array, c.num_attention_heads)
            elif family == "llama" and "attn_k" in name:
                array = converter_permute(array, c.num_key_value_heads)
        w.add_tensor(name, np.ascontiguousarray(array))
    if scaling is not None:
        factors = converter_rope_factors(head_dim, _theta(scaling), scaling)
        w.add_tensor("rope_freqs.weight", factors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


CONVERTER_CASES = [("llama", False, None), ("llama", True, LLAMA3), ("qwen2", True, None)]


@pytest.mark.parametrize(("family", "tied", "scaling"), CONVERTER_CASES)
def test_converter_layout_file_gives_transformers_logits(tmp_path, family, tied, scaling):
    """A file in llama.cpp's converter's layout (q/k rows permuted for llama, not for qwen2;
    Llama 3's scaling as a rope_freqs tensor; no output tensor when tied) computes the
    logits of the transformers model it was written from."""
    hf = _hf_model(family, tied, scaling)
    path = tmp_path / f"{family}.gguf"
    _write_converter_file(hf, family, path, scaling)
    model, _ = load_gguf(path)
    c = model.config
    assert (c.n_heads, c.n_kv_heads, c.tie_embeddings, c.qkv_bias) == (
        4, 2, tied, family == "qwen2"
    )  # fmt: skip
    assert (c.rope_scaling is not None) == (scaling is not None)
    assert (model.lm_head.weight is model.tok_emb.weight) == tied  # one parameter, not two
    ids = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = model(ids)[0]
    scale = theirs.abs().max().item()
    assert scale > 3.0  # logits that tell layouts apart: a wrong one is off by whole units
    assert (ours - theirs).abs().max().item() <= 2e-5 * scale  # float32 rounding


QUANT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "F16", "BF16"]  # fmt: skip
# where each K-quant block keeps its f16 super-block scales (d, dmin): byte offsets
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _blocks(qtype, rows: int, cols: int) -> np.ndarray:
    """A [rows, cols] tensor's bytes in `qtype`: gguf.quants.quantize where gguf-py can
    quantise to it, else random blocks with finite f16 scales."""
    rng = np.random.default_rng(0)
    values = rng.normal(0.0, 1.0, (rows, cols)).astype(np.float32)
    name = qtype.name
    if name not in _K_SCALES:
        return gguf.quants.quantize(values, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in _K_SCALES[name]:
        scale = rng.uniform(0.01, 0.1, (rows, cols // block)).astype(np.float16)
        data[..., offset : offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_dequantisation_equals_gguf_py(tmp_path, name):
    """Each quantisation type, read from a tiny GGUF file, equals gguf-py's own dequantisation
    of the same blocks, row by row, in the tensor's shape."""
    qtype = gguf.GGMLQuantizationType[name]
    data = _blocks(qtype, 6, 512)
    w = gguf.GGUFWriter(tmp_path / "q.gguf", "llama")
    w.add_tensor("t.weight", data, raw_dtype=qtype)
    w.add_tensor("u.weight", np.arange(3, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _, tensors = _read(tmp_path / "q.gguf")
    want = np.stack([gguf.quants.dequantize(row, qtype) for row in data])
    assert tensors["t.weight"].shape == (6, 512)
    assert np.isfinite(want).all()
    assert np.array_equal(tensors["t.weight"].numpy(), want.astype(np.float32))


@needs_smollm2
def test_smollm2_gguf_matches_transformers_and_answers_paris():
    """SmolLM2-135M-Instruct's Q4_1 file (llama, 9/3 heads, rope base 1e5, tied): logits
    within 1e-3 of transformers' GGUF reader of the same file on a ChatML prompt, and the same
    greedy answer, which names Paris; its tokenizer keeps the chat template and <|im_end|>."""
    from transformers import AutoModelForCausalLM

    model, tok = load_gguf(SMOLLM2_GGUF)
    c = model.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.rope_base) == (30, 576, 9, 3, 1e5)
    assert c.tie_embeddings
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt, allowed_special="all")
    end = tok.encode("<|im_end|>", allowed_special="all")
    assert len(end) == 1 and end[0] in tok.eos_token_ids
    assert "<|im_start|>" in tok.chat_template
    hf = AutoModelForCausalLM.from_pretrained(
        SMOLLM2_GGUF.parent, gguf_file=SMOLLM2_GGUF.name, torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits
        ours = model(torch.tensor([ids]))[0]
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert (ours - theirs).abs().max().item() <= 1e-3
    got = greedy(model, ids, 8)
    assert got == want[0, len(ids) :].tolist()
    assert "Paris" in tok.decode(got)


def _rewrite(src, dst, **changes):
    """A copy of GGUF file `src` with some metadata values replaced (key: value)."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = changes.get(field.name.replace(".", "_"), field.contents())
        writer.add_key_value(field.name, value, field.types[0], field.types[-1])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"llama_attention_head_count_kv": 1}, "head_count_kv 1"),  # k/v widths change
        ({"llama_attention_head_count": 3}, "not a multiple of head_count 3"),
        ({"llama_rope_dimension_count": 4}, "partial rotary"),
        ({"llama_feed_forward_length": 40}, "mlp.fc.weight: file (48, 64) vs model (40, 64)"),
    ],
)
def test_converter_file_whose_metadata_disagrees_with_its_tensors_is_refused(
    tmp_path, capsys, changes, words
):
    """A file from elsewhere (no decoderlm digest) whose head counts, rotary width or MLP width
    were edited so that they no longer fit its tensors: one line, not a wrong model."""
    _write_converter_file(_hf_model("llama", False, None), "llama", tmp_path / "a.gguf")
    _rewrite(tmp_path / "a.gguf", tmp_path / "b.gguf", **changes)
    argv = ["sample", "--gguf", str(tmp_path / "b.gguf"), "--prompt", "Hi"]
    one_line_error(capsys, argv, "b.gguf", words)


def test_edited_hyperparameter_of_an_export_is_refused(tmp_path, capsys):
    """Head count 2 -> 4 in decoderlm's own export leaves every tensor shape as it was (the
    head width halves): the digest, which covers the hyperparameters, refuses the file."""
    make_model_dir(tmp_path / "run", "llama", "byte")
    path = tmp_path / "m.gguf"
    assert main(["export", "--run", str(tmp_path / "run"), "--format", "gguf",
                 "--out", str(path)]) == 0  # fmt: skip
    _rewrite(path, tmp_path / "e.gguf", llama_attention_head_count=4,
             llama_attention_head_count_kv=4, llama_attention_key_length=8,
             llama_attention_value_length=8, llama_rope_dimension_count=8)  # fmt: skip
    argv = ["sample", "--gguf", str(tmp_path / "e.gguf"), "--prompt", "Hi"]
    capsys.readouterr()
    one_line_error(capsys, argv, "sha256", DIGEST_KEY, "--no-verify")
    _rewrite(path, tmp_path / "same.gguf")  # rewritten unchanged: still verifies
    load_gguf(tmp_path / "same.gguf")


@pytest.mark.parametrize("keep", [0.6, 0.999, 40, 2000])
def test_truncated_gguf_says_truncated(tmp_path, capsys, keep):
    """A file cut short (in its tensor data, or in its header) is one line saying so."""
    make_model_dir(tmp_path / "run", "llama", "byte")
    path = tmp_path / "m.gguf"
    assert main(["export", "--run", str(tmp_path / "run"), "--format", "gguf",
                 "--out", str(path)]) == 0  # fmt: skip
    data = path.read_bytes()
    path.write_bytes(data[: int(keep * len(data)) if keep < 1 else keep])
    capsys.readouterr()
    one_line_error(capsys, ["sample", "--gguf", str(path), "--prompt", "Hi"], "truncated")


EXPORT_SHAPES = {  # make_model_dir fields over the "llama" shape
    "gqa-untied": dict(n_heads=4, n_kv_heads=2),
    "gqa-tied-head_dim": dict(n_heads=4, n_kv_heads=1, head_dim=16, tie_embeddings=True),
    "qwen2": dict(n_heads=4, n_kv_heads=2, qkv_bias=True, tie_embeddings=True),
    "llama3-scaling": dict(n_heads=4, n_kv_heads=2, head_dim=16, rope_scaling=LLAMA3),
}


def _export_shape(tmp_path, shape: str, dtype: str = "f32"):
    model, tok = make_model_dir(tmp_path / "run", "llama", "byte", **EXPORT_SHAPES[shape])
    out = tmp_path / f"{shape}.gguf"
    assert main(["export", "--run", str(tmp_path / "run"), "--format", "gguf",
                 "--out", str(out), "--outtype", dtype]) == 0  # fmt: skip
    return model, tok, out


@pytest.mark.parametrize("shape", list(EXPORT_SHAPES))
def test_export_of_llama_family_reads_back_and_through_transformers(tmp_path, shape):
    """GQA, a wider head_dim, Qwen2's biases and Llama 3's scaling written as llama.cpp's
    converter writes them: decoderlm reads the file back exactly, and transformers' GGUF reader
    (which undoes llama's permutation itself) computes the same logits where it reads the
    option (it ignores rope_freqs, so the scaled model is checked by decoderlm alone)."""
    from transformers import AutoModelForCausalLM

    model, _, out = _export_shape(tmp_path, shape)
    arch = gguf.GGUFReader(out).fields["general.architecture"].contents()
    assert arch == ("qwen2" if shape == "qwen2" else "llama")
    back, _ = load_gguf(out)
    fields = ("n_heads", "n_kv_heads", "head_dim", "qkv_bias", "tie_embeddings", "rope_base")
    assert [getattr(back.config, f) for f in fields] == [getattr(model.config, f) for f in fields]
    if model.config.rope_scaling is not None:  # recovered from llama.cpp's rope_freqs
        got = dict(back.config.rope_scaling)
        assert got.pop("rope_type") == "llama3"
        assert got == pytest.approx({k: v for k, v in LLAMA3.items() if k != "rope_type"})
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids)[0]
        if shape == "llama3-scaling":  # its frequencies refitted from float32 divisors
            assert (back(ids)[0] - ref).abs().max().item() <= 1e-4
        else:
            assert torch.equal(back(ids)[0], ref)
        if shape != "llama3-scaling":
            hf = AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name).eval()
            assert (hf(ids).logits - ref).abs().max().item() <= 1e-4


def test_qwen2_with_rope_scaling_is_refused_for_gguf(tmp_path, capsys):
    fields = dict(EXPORT_SHAPES["qwen2"], rope_scaling=LLAMA3)
    make_model_dir(tmp_path / "run", "llama", "byte", **fields)
    argv = ["export", "--run", str(tmp_path / "run"), "--format", "gguf",
            "--out", str(tmp_path / "m.gguf")]  # fmt: skip
    one_line_error(capsys, argv, "rope_scaling")


_LLAMA_CPP_GREEDY = """
import json, sys
from llama_cpp import Llama
path, prompt, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(path, n_ctx=32, n_threads=2, verbose=False)
got = []
for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
    got.append(token)
    if len(got) == n:
        break
print(json.dumps(got))
"""


@needs_llama_cpp
@pytest.mark.parametrize("shape", list(EXPORT_SHAPES))
@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_export_of_llama_family_through_llama_cpp(tmp_path, shape, dtype):
    """llama.cpp runs the exports (GQA, head_dim, qwen2 biases, rope_freqs) with the greedy
    tokens decoderlm gives on its own reading of the same file. In a child process at 2
    threads, so a build whose q8_0 path faults (SIGILL) fails here with its signal."""
    _, tok, out = _export_shape(tmp_path, shape, dtype)
    prompt = tok.encode(MIXED_TEXT, allowed_special="all")[:8]
    code = [sys.executable, "-c", _LLAMA_CPP_GREEDY, str(out), json.dumps(prompt), "12"]
    done = subprocess.run(code, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"llama.cpp exited {done.returncode}: {done.stderr[-500:]}"
    got = json.loads(done.stdout)
    if dtype == "f32":
        assert got == greedy(load_gguf(out)[0], prompt, 12)
        return
    # q8_0: llama.cpp also rounds the activations to 8 bits, so on this random model's
    # near-tied logits its greedy path may part from ours; each token it picks must be one
    # our reading of the same file scores within the q8_0 rounding of its best
    model = load_gguf(out)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got]))[0][0, len(prompt) - 1 : -1]
    gaps = logits.max(-1).values - logits[torch.arange(len(got)), torch.tensor(got)]
    spread = (logits.max(-1).values - logits.min(-1).values).min().item()
    assert gaps.max().item() <= 0.02 * spread, (gaps.tolist(), spread)
    assert (gaps == 0).sum().item() >= len(got) - 2  # its own top choice nearly everywhere
