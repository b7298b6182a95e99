"""`decoderlm export --format hf`: transformers loads the directory with no extra arguments and
computes decoderlm's logits, greedy tokens and token ids; and every refusal of
`decoderlm export` is one line with exit status 2 and leaves nothing behind."""

from __future__ import annotations

import re

import pytest
import torch
from export_models import MIXED_TEXT, greedy, make_model_dir

from decoderlm.cli import main
from decoderlm.config import ModelConfig
from decoderlm.io.hf import load_hf
from decoderlm.io.targets import export_summary, export_target
from decoderlm.presets import PRESETS

transformers = pytest.importorskip("transformers")


def _export(run, out, format="hf", *extra) -> int:
    return main(["export", "--run", str(run), "--format", format, "--out", str(out), *extra])


@pytest.mark.parametrize(
    ("shape", "kind"),
    [("gpt2", "gpt2"), ("gpt2-untied-exact", "char"), ("llama", "byte"), ("llama-tied", "char")],
)
def test_hf_export_loads_in_transformers(tmp_path, shape, kind):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = make_model_dir(tmp_path / "run", shape, kind)
    assert _export(tmp_path / "run", tmp_path / "hf") == 0
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, tok.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids)[0]
        assert (theirs(ids).logits - ref).abs().max().item() <= 1e-4
        assert torch.equal(load_hf(tmp_path / "hf")[0](ids)[0], ref)  # decoderlm reads it back
        prompt = ids[:1, :8]
        new = theirs.generate(prompt, max_new_tokens=12, do_sample=False)[0, 8:].tolist()
    # transformers stops after the end-of-text token (generation_config.json's eos_token_id)
    want = greedy(model, prompt[0].tolist(), 12)
    assert new == want[: len(new)] and (len(new) == 12 or new[-1] == tok.eot_token)
    auto = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert auto.encode(MIXED_TEXT) == tok.encode(MIXED_TEXT, allowed_special="all")
    assert auto.decode(auto.encode(MIXED_TEXT)) == MIXED_TEXT
    back, back_tok = load_hf(tmp_path / "hf")
    assert back_tok.to_dict() == tok.to_dict()
    assert back.config.activation == model.config.activation  # tanh or exact GELU, kept


def test_hf_export_files(tmp_path):
    """config.json carries n_ctx beside n_positions (llama.cpp's converter reads n_ctx), and
    generation_config.json the end-of-text id."""
    from decoderlm.files import read_json

    make_model_dir(tmp_path / "run", "gpt2", "gpt2")
    assert _export(tmp_path / "run", tmp_path / "hf") == 0
    config = read_json(tmp_path / "hf" / "config.json")
    assert config["n_ctx"] == config["n_positions"] == 32
    assert read_json(tmp_path / "hf" / "generation_config.json")["eos_token_id"] == 50256


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_hf_export_half_precision(tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    model, _ = make_model_dir(tmp_path / "run", "llama")
    assert _export(tmp_path / "run", tmp_path / "hf", "hf", "--outtype", dtype) == 0
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.dtype == {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    with torch.no_grad():
        ref = model(ids)[0]
        err = (theirs.float()(ids).logits - ref).abs().max().item()
    assert err <= {"f16": 2e-3, "bf16": 1.5e-2}[dtype] * ref.abs().max().item()


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("decoderlm: error: ") and "\n" not in err
    return err


def test_refuses_the_default_preset_naming_the_options(tmp_path, capsys):
    default = {k: v for k, v in PRESETS["default"].model.items() if k != "vocab_size"}
    make_model_dir(tmp_path / "run", "gpt2", "char", **default)
    for format in ("hf", "gguf"):
        assert _export(tmp_path / "run", tmp_path / f"out-{format}", format) == 2
        err = _one_line(capsys)
        for option in ("QK-norm", "qk_norm=True", "mlp='relu2'", "logit_softcap=15.0"):
            assert option in err
        assert "--preset" in err and "--qk-norm false" in err
        assert not (tmp_path / f"out-{format}").exists()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(norm_position="post"), "norm_position='post'"),
        (dict(pos_encoding="sinusoidal"), "pos_encoding='sinusoidal'"),
        (dict(pos_encoding="rope"), "pos_encoding='rope'"),
    ],
)
def test_target_refuses_options_without_counterpart(fields, named):
    config = ModelConfig(vocab_size=65, block_size=32, n_layers=1, n_heads=2, d_model=16, **fields)
    with pytest.raises(ValueError, match=named):
        export_target(config, "hf")
    assert "not exportable" in export_summary(config)


def _apply(config: ModelConfig, flags: str) -> ModelConfig:
    """config with the `--field value` flags of a message applied."""
    words = flags.split()
    fields = {}
    for name, value in zip(words[::2], words[1::2], strict=True):
        field = name.removeprefix("--").replace("-", "_")
        fields[field] = {"none": None, "true": True, "false": False}.get(value, value)
    return ModelConfig(**{**config.__dict__, **fields, "d_ff": None})


@pytest.mark.parametrize("format", ["hf", "gguf"])
def test_the_default_presets_refusal_names_what_blocks_and_flags_that_export(format):
    """The default preset (rotary positions, QK-norm, ReLU^2, soft-cap, LayerNorm, biases):
    the refusal says what GPT-2 and what Llama each lack, never that Llama lacks rotary
    positions nor a GELU the ReLU^2 model does not use, and each route's flags, applied
    to the model, do export it as that architecture."""
    config = ModelConfig(**PRESETS["default"].model)
    with pytest.raises(ValueError) as refused:
        export_target(config, format)
    line = str(refused.value)
    assert "\n" not in line
    gpt2, llama = line.split("GPT-2 has no ")[1].split("; Llama has no ")
    assert "rotary positions (pos_encoding='rope')" in gpt2 and "rotary" not in llama
    assert "LayerNorm (norm='layernorm')" in llama and "biases (bias=True)" in llama
    for lacks in (gpt2, llama):
        assert "QK-norm (qk_norm=True)" in lacks and "a ReLU^2 MLP (mlp='relu2')" in lacks
    assert "activation" not in line.split("; so the file")[0]  # the MLP is named, not GELU
    assert "docs/export.md" in line
    routes = re.findall(
        r"(?:train with|or with) ((?:--[a-z-]+ [^ ]+ ?)+) \(or [^)]*\) to export as (\w+)", line
    )
    assert [arch for _, arch in routes] == ["gpt2", "llama"]
    for flags, arch in routes:
        assert export_target(_apply(config, flags), format) == arch
    summary = export_summary(config)
    ways = re.findall(r"((?:--[a-z-]+ [^ ]+ ?)+) \(as (\w+)\)", summary)
    assert [arch for _, arch in ways] == ["gpt2", "llama"]
    for flags, arch in ways:  # the train's end names flags that export to both formats
        exported = _apply(config, flags)
        assert export_target(exported, "hf") == export_target(exported, "gguf") == arch


def test_summary_of_exportable_models():
    gpt2 = ModelConfig(**PRESETS["gpt2"].model)
    assert export_target(gpt2, "gguf") == "gpt2"
    assert export_summary(gpt2).startswith("export: this model exports to hf and gguf as gpt2")
    classic = ModelConfig(**{**PRESETS["classic"].model})  # exact GELU: hf only
    assert "not to gguf" in export_summary(classic)
    llama = ModelConfig(**PRESETS["llama-tiny"].model)
    assert export_target(llama, "hf") == export_target(llama, "gguf") == "llama"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--format", "onnx"], "expected one of hf, gguf, got 'onnx'"),
        (["--outtype", "q4_0"], "expected one of f32, f16, bf16, q8_0, got 'q4_0'"),
        (["--outtype", "q8_0"], "q8_0 is a GGUF quantisation"),
    ],
)
def test_refuses_unknown_format_and_dtype(tmp_path, capsys, args, words):
    make_model_dir(tmp_path / "run", "gpt2")
    argv = [
        "export",
        "--run",
        str(tmp_path / "run"),
        "--format",
        "hf",
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(argv + args) == 2
    assert words in _one_line(capsys)
    assert not (tmp_path / "o").exists()


def _tree(root) -> dict:
    """Every file and folder under `root`: its relative path and its bytes (None: a folder)."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def test_refuses_existing_output_without_overwrite(tmp_path, capsys):
    make_model_dir(tmp_path / "run", "gpt2")
    assert _export(tmp_path / "run", tmp_path / "hf") == 0
    before = _tree(tmp_path / "hf")
    assert _export(tmp_path / "run", tmp_path / "hf") == 2
    assert "--overwrite" in _one_line(capsys)
    assert _tree(tmp_path / "hf") == before


def _another_run(path):
    """A run directory of another model: its weights, checkpoints and metrics."""
    make_model_dir(path, "gpt2", seed=3)
    (path / "checkpoints" / "step-00000010").mkdir(parents=True)
    (path / "checkpoints" / "step-00000010" / "model.safetensors").write_bytes(b"weights")
    (path / "metrics.jsonl").write_text('{"step": 10, "loss": 3.2}\n')


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
@pytest.mark.parametrize(
    ("fill", "named"), [("notes", "thesis.txt"), ("run", "checkpoints/, metrics.jsonl")]
)
def test_an_out_folder_holding_other_files_is_refused_and_left_as_it_was(
    tmp_path, capsys, overwrite, fill, named
):
    """An hf export replaces only the files a hf export writes: an --out folder that holds
    anything else (someone's notes, another run's checkpoints and metrics) is refused, with
    or without --overwrite, naming what it holds, and nothing in it changes."""
    make_model_dir(tmp_path / "run", "gpt2")
    out = tmp_path / "mywork"
    if fill == "notes":
        out.mkdir()
        (out / "thesis.txt").write_text("three years of notes")
    else:
        _another_run(out)
    before = _tree(out)
    assert _export(tmp_path / "run", out, "hf", *overwrite) == 2
    line = _one_line(capsys)
    assert f"--out {out} holds {named}" in line and "new or empty folder" in line
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mywork", "run"]  # no temp folder


def test_reexport_over_a_previous_export_replaces_its_files(tmp_path, capsys):
    """--overwrite over an earlier hf export: the folder holds exactly the files an export
    writes (HF_FILES), now the second model's, and nothing is left beside it."""
    from decoderlm.io.hf import HF_FILES

    make_model_dir(tmp_path / "first", "gpt2", seed=1)
    second, _ = make_model_dir(tmp_path / "second", "gpt2", seed=2)
    assert _export(tmp_path / "first", tmp_path / "hf") == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(HF_FILES)
    assert _export(tmp_path / "second", tmp_path / "hf", "hf", "--overwrite") == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(HF_FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "hf", "second"]
    ids = torch.randint(0, second.config.vocab_size, (1, 16))
    with torch.no_grad():
        assert torch.equal(load_hf(tmp_path / "hf")[0](ids)[0], second(ids)[0])


def test_gguf_over_a_directory_is_refused_and_over_a_file_replaces_it(tmp_path, capsys):
    """A GGUF export is one file: an existing directory as --out is refused and kept, with or
    without --overwrite; an existing file is replaced with --overwrite."""
    make_model_dir(tmp_path / "run", "gpt2")
    (tmp_path / "mywork").mkdir()
    (tmp_path / "mywork" / "thesis.txt").write_text("notes")
    for extra in ([], ["--overwrite"]):
        assert _export(tmp_path / "run", tmp_path / "mywork", "gguf", *extra) == 2
        assert "is a directory; a GGUF export is one file" in _one_line(capsys)
        assert (tmp_path / "mywork" / "thesis.txt").read_text() == "notes"
    (tmp_path / "m.gguf").write_bytes(b"old")
    assert _export(tmp_path / "run", tmp_path / "m.gguf", "gguf", "--overwrite") == 0
    assert (tmp_path / "m.gguf").read_bytes()[:4] == b"GGUF"


@pytest.mark.parametrize("format", ["hf", "gguf"])
def test_out_in_a_folder_that_does_not_exist_makes_it_and_says_so(tmp_path, capsys, format):
    make_model_dir(tmp_path / "run", "gpt2")
    out = tmp_path / "exports" / "tiny" / ("hf" if format == "hf" else "m.gguf")
    assert _export(tmp_path / "run", out, format) == 0
    assert f"(made the folder {out.parent})" in capsys.readouterr().out
    assert out.exists() and (out.is_dir() if format == "hf" else out.is_file())


def test_out_under_a_file_is_one_line(tmp_path, capsys):
    make_model_dir(tmp_path / "run", "gpt2")
    (tmp_path / "notes.txt").write_text("notes")
    assert _export(tmp_path / "run", tmp_path / "notes.txt" / "hf") == 2
    assert f"{tmp_path / 'notes.txt'} is a file, not a folder" in _one_line(capsys)
    assert (tmp_path / "notes.txt").read_text() == "notes"


@pytest.mark.parametrize("inside", ["checkpoints", "samples/early"])
def test_run_given_as_a_folder_inside_the_run_names_the_run_directory(tmp_path, capsys, inside):
    """--run RUN/checkpoints (or any folder in a run without config.json) names the run."""
    run = tmp_path / "run"
    _another_run(run)
    (run / "samples" / "early").mkdir(parents=True)
    assert _export(run / inside, tmp_path / "hf") == 2
    line = _one_line(capsys)
    assert f"give --run {run}" in line and "config.json not found" not in line
    assert not (tmp_path / "hf").exists()


def test_run_given_as_the_checkpoints_of_an_unfinished_run_names_the_run(tmp_path, capsys):
    """A run still training has checkpoints/ but no config.json yet."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert _export(tmp_path / "run" / "checkpoints", tmp_path / "hf") == 2
    assert f"give --run {tmp_path / 'run'}" in _one_line(capsys)


def test_refuses_run_without_weights(tmp_path, capsys):
    make_model_dir(tmp_path / "run", "gpt2")
    (tmp_path / "run" / "model.safetensors").unlink()
    assert _export(tmp_path / "run", tmp_path / "m.gguf", "gguf") == 2
    assert "model.safetensors not found" in _one_line(capsys)
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("format", ["hf", "gguf"])
def test_failed_write_leaves_nothing(tmp_path, monkeypatch, format):
    """A write that fails part-way (here: the disk 'fills' while writing the weights) leaves
    no output and no temporary file beside it."""
    import decoderlm.io.gguf as gguf_module
    import decoderlm.io.hf_gpt2 as gpt2_module
    import decoderlm.io.hf_llama as llama_module

    make_model_dir(tmp_path / "run", "gpt2")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if format == "hf":
        monkeypatch.setattr(llama_module, "save_file", full)
        monkeypatch.setattr(gpt2_module, "save_file", full)
    else:
        monkeypatch.setattr(gguf_module, "_encoded", full)
    for out in (tmp_path / "hf", tmp_path / "new" / "hf"):  # the folder it made goes too
        out = out.with_suffix("" if format == "hf" else ".gguf")
        assert _export(tmp_path / "run", out, format) == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_python_export_refuses_like_the_command(tmp_path):
    from decoderlm.io.export import export

    make_model_dir(tmp_path / "run", "gpt2")
    for kwargs, words in (
        (dict(format="onnx"), "unknown format 'onnx'"),
        (dict(format="gguf", outtype="q4_0"), "unknown outtype 'q4_0'"),
    ):
        with pytest.raises(ValueError, match=words):
            export(tmp_path / "run", out=tmp_path / "o", **kwargs)
    assert export(tmp_path / "run", "gguf", tmp_path / "m.gguf", "f16") == tmp_path / "m.gguf"


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--preset", "classic", "--activation", "gelu_tanh"], "exports to hf and gguf as gpt2"),
        (["--preset", "classic"], "exports to hf as gpt2 (decoderlm export --run"),
        ([], "this model is not exportable (GPT-2 has no QK-norm (qk_norm=True)"),
    ],
)
def test_train_says_whether_the_run_exports(tmp_path, capsys, flags, line):
    tiny = ["--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--block-size", "32"]
    steps = ["--batch-size", "4", "--max-steps", "2", "--eval-interval", "2"]
    assert main(["train", *flags, *tiny, *steps, "--out", str(tmp_path / "run")]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("export: ") and line in last


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_padded_vocabulary_exports_its_real_rows(tmp_path, shape):
    """A padded vocabulary (extra embedding rows no token uses) is written with its
    vocab_size real rows: transformers and the GGUF file see the tokenizer's size."""
    from transformers import AutoModelForCausalLM

    from decoderlm.io.gguf import load_gguf

    model, tok = make_model_dir(tmp_path / "run", shape, "char", padded_vocab_size=64)
    assert _export(tmp_path / "run", tmp_path / "hf") == 0
    assert _export(tmp_path / "run", tmp_path / "m.gguf", "gguf") == 0
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.config.vocab_size == tok.vocab_size < 64
    ids = torch.randint(0, tok.vocab_size, (1, 16))
    with torch.no_grad():
        ref = model(ids)[0]
        assert (theirs(ids).logits - ref).abs().max().item() <= 1e-4
        assert torch.equal(load_gguf(tmp_path / "m.gguf")[0](ids)[0], ref)


@pytest.mark.parametrize(
    ("format", "where"),
    [("hf", "."), ("hf", "checkpoints"), ("gguf", "model.safetensors"), ("hf", "..")],
)
def test_refuses_output_over_the_run_itself(tmp_path, capsys, format, where):
    """--overwrite replaces what --out names; an --out that is the run directory, inside it,
    or above it would delete or overwrite the weights being exported, so it is refused; a new
    file in the run directory is fine."""
    run = tmp_path / "runs" / "run"
    make_model_dir(run, "gpt2")
    (run / "checkpoints").mkdir()
    before = sorted(p.name for p in run.iterdir())
    weights = (run / "model.safetensors").read_bytes()
    assert _export(run, run / where, format, "--overwrite") == 2
    assert "the run directory" in _one_line(capsys)
    assert sorted(p.name for p in run.iterdir()) == before
    assert (run / "model.safetensors").read_bytes() == weights
    assert _export(run, run / "model.gguf", "gguf", "--overwrite") == 0
    assert (run / "model.safetensors").read_bytes() == weights


def test_gguf_refusal_names_a_preset_that_exports_to_gguf(tmp_path, capsys):
    """The preset a gguf refusal suggests for gpt2 must itself export to gguf: the classic
    preset's exact GELU does not, so the hint adds --activation gelu_tanh."""
    default = {k: v for k, v in PRESETS["default"].model.items() if k != "vocab_size"}
    make_model_dir(tmp_path / "run", "gpt2", "char", **default)
    assert _export(tmp_path / "run", tmp_path / "out.gguf", "gguf") == 2
    assert "(or --preset classic --activation gelu_tanh) to export as gpt2" in _one_line(capsys)
    classic = ModelConfig(**{**PRESETS["classic"].model, "activation": "gelu_tanh"})
    assert export_target(classic, "gguf") == "gpt2"


@pytest.mark.parametrize(
    ("shape", "field", "value"),
    [("gpt2", "n_head", 4), ("llama", "rope_theta", 500000.0), ("gpt2", "layer_norm_epsilon", 0.1)],
)
def test_an_edited_config_of_an_export_is_refused(tmp_path, capsys, shape, field, value):
    """An export's config.json with another head count (the weights' shapes are the same:
    2 or 4 heads of a 32-wide model), rotary base or epsilon would load and compute something
    else: the values the export wrote are recorded inside model.safetensors, whose sha256
    config.json records, and reading refuses the edit in one line, with --no-verify too."""
    import json

    make_model_dir(tmp_path / "run", shape, "char")
    assert _export(tmp_path / "run", tmp_path / "hf") == 0
    capsys.readouterr()
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    assert config[field] != value
    sample = ["sample", "--hf", str(tmp_path / "hf"), "--prompt", "a", "--max-new-tokens", "1"]
    assert main(sample) == 0  # as exported: loads
    path.write_text(json.dumps({**config, field: value}), encoding="utf-8")
    for flags in ([], ["--no-verify"]):
        assert main([*sample, *flags]) == 2
        line = _one_line(capsys)
        assert f"{field}={value!r} (written with {config[field]!r})" in line
        assert "restore config.json" in line


def test_a_gpt2_config_whose_width_the_heads_do_not_divide_is_refused(tmp_path, capsys):
    """For directories from elsewhere (nothing recorded): n_embd must be a multiple of n_head."""
    import json

    make_model_dir(tmp_path / "run", "gpt2", "char")
    assert _export(tmp_path / "run", tmp_path / "hf") == 0
    capsys.readouterr()
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**config, "n_head": 3}), encoding="utf-8")
    assert main(["sample", "--hf", str(tmp_path / "hf"), "--prompt", "a"]) == 2
    assert "n_head" in _one_line(capsys)
