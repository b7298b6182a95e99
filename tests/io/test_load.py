"""The one loader (`decoderlm.io.load`): a run directory, a Hugging Face directory and a GGUF
file give the same model and tokenizer, whether the source is told apart by its path
(`load_model_and_tokenizer`, `load_model`, `load_tokenizer`) or named by its flag
(`load_from_flags`), each model stopping at its tokenizer's end-of-text id."""

from __future__ import annotations

import re

import pytest
import torch
from export_models import make_model_dir

import decoderlm
from decoderlm.cli import main
from decoderlm.errors import UserError
from decoderlm.io.load import (
    load_from_flags,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    source_kind,
)


@pytest.fixture(scope="module", params=[("gpt2", "char"), ("llama", "byte")])
def sources(request, tmp_path_factory):
    """{kind: path} of one model as a run directory, a Hugging Face directory and a GGUF
    file, and the model and tokenizer written."""
    pytest.importorskip("gguf")
    shape, kind = request.param
    tmp = tmp_path_factory.mktemp(f"{shape}-{kind}")
    model, tok = make_model_dir(tmp / "run", shape, kind)
    for format, out in (("hf", tmp / "hf"), ("gguf", tmp / "m.gguf")):
        argv = ["export", "--run", str(tmp / "run"), "--format", format, "--out", str(out)]
        assert main(argv) == 0
    return {"run": tmp / "run", "hf": tmp / "hf", "gguf": tmp / "m.gguf"}, model, tok


def test_each_source_is_told_apart_by_its_path(sources, tmp_path):
    paths, _, _ = sources
    assert {kind: source_kind(path) for kind, path in paths.items()} == {
        "run": "run",
        "hf": "hf",
        "gguf": "gguf",
    }
    assert source_kind(tmp_path / "missing.gguf") == "gguf"
    assert source_kind(tmp_path / "missing") == "run"  # whose loader names what is missing


def test_every_source_gives_the_same_model_tokenizer_and_end_of_text(sources):
    paths, written, tok = sources
    idx = torch.tensor([[1, 5, 2, 7, 3]])
    with torch.no_grad():
        expected = written(idx)[0]
    for kind, path in paths.items():
        for model, tokenizer in (
            load_model_and_tokenizer(path),
            load_from_flags(**{kind: str(path)}),
            (load_model(path), load_tokenizer(path)),
            (decoderlm.load_model(path), decoderlm.load_tokenizer(path)),
        ):
            assert tokenizer.to_dict() == tok.to_dict(), kind
            assert tok.eot_token is not None and model.eos_token_id == tok.eot_token, kind
            assert not model.training, kind
            with torch.no_grad():
                assert (model(idx)[0] - expected).abs().max() < 1e-4, kind


def test_every_source_fills_its_weights_without_a_random_start_and_keeps_them_tied(
    sources, monkeypatch
):
    # a loader builds the model with its parameters unallocated and takes the tensors it read
    # as them: no random initialisation (seconds at 10^8 parameters) and no second copy; a
    # tied unembedding stays one parameter (counted once) from every format
    paths, written, _ = sources
    normal = torch.nn.init.normal_

    def refuse_filled(tensor, *args, **kwargs):
        assert tensor.is_meta, "a loader initialised weights it was about to overwrite"
        return normal(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "normal_", refuse_filled)
    for kind, path in paths.items():
        model = load_model(path)
        assert not any(p.is_meta for p in model.parameters()), kind
        assert {p.dtype for p in model.parameters()} == {torch.float32}, kind
        tied = model.lm_head.weight is model.tok_emb.weight
        assert tied == written.config.tie_embeddings, kind
        assert model.num_parameters() == written.num_parameters(), kind


def test_each_flag_reads_its_own_kind_only(sources, capsys):
    paths, _, _ = sources
    with pytest.raises(UserError, match="give one of --run, --hf or --gguf"):
        load_from_flags()
    with pytest.raises(
        UserError, match="^give only one of --run, --hf or --gguf, not --run and --hf$"
    ):
        load_from_flags(run=paths["run"], hf=paths["hf"])
    with pytest.raises(UserError, match=", not --run, --hf and --gguf$"):
        load_from_flags(run=paths["run"], hf=paths["hf"], gguf=paths["gguf"])
    with pytest.raises(UserError, match="has no 'model' entry"):
        load_from_flags(run=paths["hf"])
    with pytest.raises(UserError, match="no 'model_type'.*use --run"):
        load_from_flags(hf=paths["run"])
    with pytest.raises(UserError, match="is a directory; --gguf takes one GGUF file"):
        load_from_flags(gguf=paths["run"])
    with pytest.raises(UserError, match="for a GGUF file use --gguf"):
        load_from_flags(run=paths["gguf"])
    with pytest.raises(UserError, match="unknown device"):
        load_from_flags(run=paths["run"], device="tpu")


def test_a_path_another_flag_takes_is_named_with_that_flag(sources, capsys):
    """A run's checkpoints/ folder given to --run names the run directory to give; a GGUF
    file given to --hf says to use --gguf (every command loads through load_from_flags)."""
    paths, _, _ = sources
    folder = paths["run"] / "checkpoints"
    folder.mkdir(exist_ok=True)
    with pytest.raises(
        UserError, match=f"inside the run directory {re.escape(str(paths['run']))}.*give --run"
    ):
        load_from_flags(run=folder)
    with pytest.raises(UserError, match="is a file, not a Hugging Face directory; give --gguf"):
        load_from_flags(hf=paths["gguf"])
    with pytest.raises(UserError, match="is a file, not a Hugging Face directory; give its dir"):
        load_from_flags(hf=paths["hf"] / "config.json")
    argv = ["sample", "--run", str(folder), "--max-new-tokens", "1"]
    assert main(argv) == 2
    assert "give --run" in capsys.readouterr().err


def test_a_tokenizer_of_another_vocabulary_is_refused_for_every_source(tmp_path):
    make_model_dir(tmp_path / "run", "gpt2", "char")
    decoderlm.ByteTokenizer().save_pretrained(tmp_path / "run")  # 256 ids, not the model's
    for load in (load_model_and_tokenizer, lambda p: load_from_flags(run=p)):
        with pytest.raises(UserError, match="has 256 tokens but the model expects vocab_size="):
            load(tmp_path / "run")


def test_a_run_read_alone_gets_the_end_of_text_id_of_its_saved_tokenizer(tmp_path):
    # DecoderLM.from_pretrained and load_model read it from the tokenizer file (GPT-2's
    # without building its BPE tables); a vocabulary without the token gives None
    make_model_dir(tmp_path / "gpt2", "gpt2", "gpt2")
    make_model_dir(tmp_path / "char", "gpt2", "char")
    decoderlm.CharTokenizer(sorted(set("abc"))).save_pretrained(tmp_path / "plain")
    assert decoderlm.DecoderLM.from_pretrained(tmp_path / "gpt2").eos_token_id == 50256
    char_eot = decoderlm.load_tokenizer(tmp_path / "char").eot_token
    assert load_model(tmp_path / "char").eos_token_id == char_eot is not None
    model = decoderlm.DecoderLM.from_pretrained(tmp_path / "char")
    assert model.set_end_of_text(None).eos_token_id is None
    with pytest.raises(UserError, match="an end-of-text id is an integer"):
        model.set_end_of_text("3")


def test_an_adapter_directory_loads_over_its_base_with_its_end_of_text(tmp_path):
    # a LoRA directory (adapters alone, the base recorded by path and sha256) loads merged or
    # not, with the base's logits moved by the adapters, and stops at its tokenizer's id
    from decoderlm.io.load import weights_sha256
    from decoderlm.model.lora import apply_lora
    from decoderlm.model.weights import save_model

    base, tok = make_model_dir(tmp_path / "base", "gpt2", "char")
    adapted = decoderlm.DecoderLM.from_pretrained(tmp_path / "base")
    modules = apply_lora(adapted, rank=2, alpha=4.0, targets="qkv,fc")
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.5)
    lora = {"rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": "qkv,fc", "modules": modules}
    init_from = {"path": str(tmp_path / "base"), "sha256": weights_sha256(tmp_path / "base")}
    save_model(adapted, tmp_path / "lora", {"lora": lora, "init_from": init_from})
    tok.save_pretrained(tmp_path / "lora")
    idx = torch.tensor([[1, 5, 2, 7, 3]])
    with torch.no_grad():
        want = adapted(idx)[0]
        assert (want - base(idx)[0]).abs().max() > 1e-2  # the adapters change the logits
        for model in (
            load_model(tmp_path / "lora"),
            load_model(tmp_path / "lora", merge=False),
            load_model_and_tokenizer(tmp_path / "lora")[0],
            load_from_flags(run=tmp_path / "lora")[0],
        ):
            assert (model(idx)[0] - want).abs().max() < 1e-4
            assert model.eos_token_id == tok.eot_token is not None
    out = tmp_path / "exported"  # export, as every command, loads it over its base
    assert (
        main(["export", "--run", str(tmp_path / "lora"), "--format", "hf", "--out", str(out)]) == 0
    )
    with torch.no_grad():
        assert (load_model(out)(idx)[0] - want).abs().max() < 1e-4
    make_model_dir(tmp_path / "base", "gpt2", "char", seed=1)  # other weights, same shape
    with pytest.raises(UserError, match="changed since .* was trained from it"):
        load_model(tmp_path / "lora")
