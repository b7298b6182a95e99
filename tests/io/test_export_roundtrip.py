"""Exported files load back: `decoderlm sample --hf DIR` / `--gguf FILE` continue a prompt as
`decoderlm sample --run RUN` does, and GGUF files in the layout llama.cpp's own converter
(convert_hf_to_gguf.py) writes for GPT-2 load with the same logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from export_models import make_model_dir
from safetensors.torch import load_file

from decoderlm.cli import main
from decoderlm.io.gguf import load_gguf
from decoderlm.model.model import DecoderLM


def _sample(capsys, *source) -> str:
    argv = ["sample", *source, "--prompt", "Hello", "--temperature", "0"]
    assert main([*argv, "--max-new-tokens", "12"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(("shape", "kind"), [("gpt2", "gpt2"), ("llama", "char")])
def test_sample_reads_exports(tmp_path, capsys, shape, kind):
    make_model_dir(tmp_path / "run", shape, kind)
    want = _sample(capsys, "--run", str(tmp_path / "run"))
    for format, out in (("hf", tmp_path / "hf"), ("gguf", tmp_path / "m.gguf")):
        argv = ["export", "--run", str(tmp_path / "run"), "--format", format, "--out", str(out)]
        assert main(argv) == 0
        capsys.readouterr()
        assert _sample(capsys, f"--{format}", str(out)) == want


def _converter_layout(hf_dir: Path, out: Path, duplicate_output: bool) -> None:
    """Write a transformers GPT-2 directory as llama.cpp's convert_hf_to_gguf.py does (class
    GPT2Model): the four Conv1D weights transposed, llama.cpp's names, feed_forward_length
    4 * n_embd, the tokenizer.json vocabulary with its added tokens as CONTROL, its merges,
    pre-tokenizer "gpt-2", and no decoderlm key. Its older versions also wrote the tied
    unembedding again as output.weight (`duplicate_output`)."""
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(hf_dir / "model.safetensors")
    names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
             "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}  # fmt: skip
    top = {"wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm"}
    w = gguf.GGUFWriter(out, "gpt2")
    w.add_name("Hf")
    w.add_block_count(config["n_layer"])
    w.add_context_length(config["n_ctx"])
    w.add_embedding_length(config["n_embd"])
    w.add_feed_forward_length(4 * config["n_embd"])
    w.add_head_count(config["n_head"])
    w.add_layer_norm_eps(config["layer_norm_epsilon"])
    w.add_file_type(0)
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    added = {a["id"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(sorted(vocab, key=vocab.get))
    w.add_token_types([3 if i in added else 1 for i in range(len(vocab))])
    w.add_token_merges(tok["model"]["merges"])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    for key, tensor in state.items():
        parts = key.removeprefix("transformer.").split(".")
        if parts[0] == "h":
            module = ".".join(parts[2:-1])
            if module in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
                if parts[-1] == "weight":
                    tensor = tensor.t()
            name = f"blk.{parts[1]}.{names[module]}.{parts[-1]}"
        else:
            name = f"{top[parts[0]]}.{parts[-1]}"
        w.add_tensor(name, np.ascontiguousarray(tensor.numpy()))
        if name == "token_embd.weight" and duplicate_output:
            w.add_tensor("output.weight", np.ascontiguousarray(tensor.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sample_hf_on_a_run_directory_points_at_run(tmp_path, capsys):
    """A decoderlm run directory given to --hf (its config.json has no model_type) is refused
    in one line that says to use --run, not as a Hugging Face model of type None."""
    make_model_dir(tmp_path / "run", "gpt2")
    assert main(["sample", "--hf", str(tmp_path / "run"), "--prompt", "Hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "None" not in err
    assert f"use --run {tmp_path / 'run'}" in err


def test_run_and_gguf_swapped_say_which_flag(tmp_path, capsys):
    """A GGUF file given to --run, and a directory given to --gguf, are each one line naming
    the flag that takes it (not "not found": the path exists)."""
    make_model_dir(tmp_path / "run", "gpt2")
    assert main(["export", "--run", str(tmp_path / "run"), "--format", "gguf",
                 "--out", str(tmp_path / "m.gguf")]) == 0  # fmt: skip
    capsys.readouterr()
    for flag, path, words in (
        ("--run", tmp_path / "m.gguf", f"use --gguf {tmp_path / 'm.gguf'}"),
        ("--gguf", tmp_path / "run", "is a directory; --gguf takes one GGUF file"),
    ):
        assert main(["sample", flag, str(path), "--prompt", "Hello"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err and "not found" not in err


@pytest.mark.parametrize("duplicate_output", [False, True])
def test_reads_gguf_in_llama_cpp_converter_layout(tmp_path, capsys, duplicate_output):
    model, _ = make_model_dir(tmp_path / "run", "gpt2", "gpt2")
    assert main(["export", "--run", str(tmp_path / "run"), "--format", "hf",
                 "--out", str(tmp_path / "hf")]) == 0  # fmt: skip
    _converter_layout(tmp_path / "hf", tmp_path / "c.gguf", duplicate_output)
    back, tok = load_gguf(tmp_path / "c.gguf")
    assert type(tok).__name__ == "GPT2Tokenizer" and back.config.tie_embeddings
    ids = torch.randint(0, 50257, (2, 20))
    assert torch.equal(back(ids)[0], model(ids)[0])
    capsys.readouterr()
    want = _sample(capsys, "--run", str(tmp_path / "run"))
    assert _sample(capsys, "--gguf", str(tmp_path / "c.gguf")) == want


CONVERTER = os.environ.get("DECODERLM_LLAMA_CPP_CONVERT")  # path of convert_hf_to_gguf.py


@pytest.mark.skipif(
    not CONVERTER, reason="DECODERLM_LLAMA_CPP_CONVERT (llama.cpp's converter) unset"
)
@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_reads_gguf_of_llama_cpp_converter(tmp_path, shape):
    """llama.cpp's own convert_hf_to_gguf.py on our hf export: the file it writes loads with
    the same logits."""
    make_model_dir(tmp_path / "run", shape, "gpt2")
    assert main(["export", "--run", str(tmp_path / "run"), "--format", "hf",
                 "--out", str(tmp_path / "hf")]) == 0  # fmt: skip
    out = tmp_path / "c.gguf"
    cmd = [sys.executable, CONVERTER, str(tmp_path / "hf"), "--outfile", str(out)]
    subprocess.run([*cmd, "--outtype", "f32"], check=True, capture_output=True)
    ids = torch.randint(0, 50257, (1, 20))
    ref = DecoderLM.from_pretrained(tmp_path / "run")
    assert torch.equal(load_gguf(out)[0](ids)[0], ref(ids)[0])
