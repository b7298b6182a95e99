"""The command line itself: flags named with dashes, settings files (`--config FILE`) in every
command, one-line errors for bad flags, values and settings files."""

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
import yaml

from decoderlm.arguments import Fields, NonNegativeInt, NotEmptyPath, NotEmptyStr, PositiveInt
from decoderlm.cli import COMMANDS, main, parse
from decoderlm.cli.flags import FlagError, command_flags, convert
from decoderlm.data.prepare import prepare
from decoderlm.errors import UserError

from conftest import one_line_error, quiet, tiny_model, write_weights_by_hand

TEXT = "".join(chr(33 + (i * 7919) % 60) for i in range(3000)) + " caf\u00e9 \u6771\u4eac\n" * 20


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help_with_dashed_flags(capsys, command):
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: decoderlm")
    flags = [word for word in text.split() if word.startswith("--")]
    assert not [f for f in flags if "_" in f.split("=")[0]], flags
    if command != "presets":
        assert "--config" in text


def printed_by_fresh_process(script: str) -> str:
    """What `python -c script` prints, stripped; its exit status must be 0."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_command_list_imports_no_command_module():
    # `decoderlm --help` reads the commands' summaries from their source: no torch to import
    script = (
        "import contextlib, io, sys\n"
        "from decoderlm.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    assert main(['--help']) == 0\n"
        "assert 'Train a GPT-style model' in out.getvalue(), out.getvalue()\n"
        "print(sorted(m for m in ('torch', 'decoderlm.training.run') if m in sys.modules))\n"
    )
    assert printed_by_fresh_process(script) == "[]"


def test_the_commands_modules_leave_torch_compile_unimported():
    # torch._dynamo (torch.compile's tracer) takes about 2 s to import: importing the modules
    # of training, sampling, chat and evaluation leaves it out (it comes with compiling, a
    # weight packed for oneDNN, or torch.optim's first step)
    script = (
        "import sys\n"
        "import decoderlm.cli, decoderlm.evaluate, decoderlm.training.run\n"
        "import decoderlm.generation.chat, decoderlm.generation.sample\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    assert printed_by_fresh_process(script) == "False"


def test_train_flags_are_flat_and_keep_their_meaning(capsys):
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in (
        "--n-layers",
        "--d-model",
        "--block-size",
        "--lr",
        "--max-steps",
        "--dtype",
        "--compile",
        "--grad-clip",
        "--preset",
        "--data",
        "--dataset",
        "--max-chars",
        "--out",
        "--overwrite",
        "--resume",
        "--device",
        "--no-progress",
    ):
        assert f"{flag} " in text, flag
    assert "number of decoder blocks" in text  # field docstrings
    assert "--vocab-size VOCAB_SIZE" in text and "--padded-vocab-size" in text
    command, train = parse(
        [
            "train",
            "--grad-clip",
            "none",
            "--compile",
            "--bias",
            "false",
            "--d-ff",
            "none",
            "--n-layers",
            "2",
            "--lr",
            "1e-3",
        ]
    )
    assert command == "train" and train == {
        "model_overrides": {"bias": False, "d_ff": None, "n_layers": 2},
        "train_overrides": {"grad_clip": None, "compile": True, "lr": 1e-3},
    }
    assert parse(["train", "--compile", "true"])[1]["train_overrides"]["compile"] is True
    assert parse(["train"])[1] == {}  # unset: the preset decides


def test_a_settings_file_in_yaml_or_json_for_params(tmp_path, capsys):
    (tmp_path / "p.yaml").write_text("preset: gpt2\nseq_len: 64\njson: true\n")
    assert main(["params", "--config", str(tmp_path / "p.yaml")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["seq_len"] == 64 and report["parameters"]["total"] == 124_439_808
    # flags override the file wherever they stand
    assert main(["params", "--seq-len", "32", "--config", str(tmp_path / "p.yaml")]) == 0
    assert json.loads(capsys.readouterr().out)["seq_len"] == 32
    tiny_model().save_pretrained(tmp_path / "run")
    (tmp_path / "p.json").write_text(
        json.dumps({"run": str(tmp_path / "run"), "json": True, "dtype": "bf16", "batch_size": 2})
    )
    assert main(["params", "--config", str(tmp_path / "p.json")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"] == tiny_model().config.to_dict() and report["batch_size"] == 2


def byte_run(directory: Path, **overrides) -> Path:
    """A run directory: tiny_model(vocab_size=256, **overrides) and the byte tokenizer."""
    from decoderlm.tokenizers import ByteTokenizer

    tiny_model(vocab_size=256, **overrides).save_pretrained(directory)
    ByteTokenizer().save_pretrained(directory)
    return directory


def test_padding_cropping_and_tied_weights_from_the_command_line(tmp_path, capsys):
    run = byte_run(tmp_path / "run", padded_vocab_size=320)
    assert main(["params", "--run", str(run)]) == 0
    assert "256 tokens in 320 embedding rows (64 padding rows" in capsys.readouterr().out
    assert main(["params", "--run", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["vocabulary"] == {"tokens": 256, "rows": 320, "padding_rows": 64}
    sample = [
        "sample",
        "--run",
        str(run),
        "--prompt",
        "ab",
        "--max-new-tokens",
        "40",
        "--seed",
        "1",
    ]
    assert main([*sample, "--block-size", "8"]) == 0
    assert capsys.readouterr().out.strip()
    one_line_error(capsys, [*sample, "--block-size", "33"], "block_size=32", "from 1 to 32")
    # two different matrices in a tied model's file
    from safetensors.torch import load_file

    state = load_file(run / "model.safetensors")
    state["lm_head.weight"] = state["tok_emb.weight"] * 2
    write_weights_by_hand(state, run)
    one_line_error(capsys, sample, "tok_emb.weight and lm_head.weight", "tie_embeddings")


def test_train_refuses_a_vocab_size_below_the_tokenizers(tmp_path, capsys):
    argv = ["train", "--vocab-size", "100", "--max-steps", "1", "--out", str(tmp_path / "r")]
    one_line_error(capsys, argv, "vocab_size 100 is smaller than the tokenizer's 139 tokens")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "text,message",
    [
        ("preset: gpt2\nbatch_size: many\n", "--batch-size: expected an integer > 0, got 'many'"),
        (
            "preset: gpt2\ndtype: fp8\n",
            "--dtype: expected one of float32, bfloat16, float16, f32, bf16, f16, fp32, fp16",
        ),
        ("preset: gpt2\nseq_lenn: 3\n", "unknown setting 'seq_lenn' in the settings file"),
        ("preset: [gpt2\n", "the settings file does not parse"),
        ("preset: gpt2\n  seq_len: 3\n", "(line 2, column 10)"),  # where YAML stopped
        ("- gpt2\n", "a settings file must map settings to values"),
    ],
)
def test_a_bad_settings_file_is_one_line(tmp_path, capsys, text, message):
    (tmp_path / "p.yaml").write_text(text)
    one_line_error(capsys, ["params", "--config", str(tmp_path / "p.yaml")], message)


def test_bad_flags_and_values_are_one_line(tmp_path, capsys):
    one_line_error(
        capsys,
        ["params", "--config", str(tmp_path / "none.yaml")],
        f"--config {tmp_path / 'none.yaml'} not found",
    )
    one_line_error(
        capsys, ["params", "--preset", "gpt3"], "--preset: expected one of classic, default"
    )
    one_line_error(
        capsys,
        ["params", "--preset", "gpt2", "--run", "x"],
        "give only one of --preset, --run or --model-config, not --preset and --run",
    )
    one_line_error(capsys, ["params"], "give one of --preset")
    one_line_error(capsys, ["params", "--model-config", str(tmp_path / "no.json")], "no.json")
    one_line_error(capsys, ["sample"], "give one of --run, --hf or --gguf")
    one_line_error(capsys, ["prepare", "--data", "x"], "missing --out")
    one_line_error(capsys, ["eval"], "give one of --run, --hf or --gguf")
    one_line_error(capsys, ["eval", "--gguf", "m.gguf"], "--gguf m.gguf records no data to score")
    one_line_error(capsys, ["train", "--n-layers"], "--n-layers: expected one argument")
    one_line_error(
        capsys,
        ["train", "--norm", "batchnorm"],
        "--norm: expected one of layernorm, rmsnorm, got 'batchnorm'",
    )
    one_line_error(capsys, ["fit"], "invalid choice: 'fit'")
    one_line_error(capsys, [], "required: COMMAND")
    one_line_error(capsys, ["--versoin"], "unknown flag '--versoin'")  # not "required: COMMAND"


def test_prepare_takes_several_data_flags(tmp_path, capsys):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(name * 200, encoding="utf-8")
    out = tmp_path / "tokens"
    assert (
        main(
            [
                "prepare",
                "--data",
                str(tmp_path / "a.txt"),
                "--data",
                str(tmp_path / "b.txt"),
                "--tokenizer",
                "byte",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    meta = json.loads((out / "meta.json").read_text())
    assert len(meta["sources"]) == 2, meta


def test_the_documented_settings_file_for_train(tmp_path):
    text = (Path(__file__).parents[1] / "docs" / "training.md").read_text(encoding="utf-8")
    example = text.split("# run.yaml:")[1].split("```")[0].split("\n", 1)[1]
    (tmp_path / "run.yaml").write_text(example)
    args = ["train", "--lr", "3e-4", "--config", str(tmp_path / "run.yaml")]
    settings = parse(args)[1]
    assert settings["preset"] == "default" and settings["out"] == "runs/input"
    assert settings["model_overrides"] == {
        "n_layers": 6,
        "d_model": 384,
        "n_heads": 6,
        "block_size": 256,
    }
    train = settings["train_overrides"]
    assert train["lr"] == 3e-4 and train["min_lr"] == 1e-4  # the flag wins
    assert train["compile"] is True and train["dtype"] == "bfloat16"


def test_settings_file_then_command_line_overrides(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    settings = tmp_path / "run.toml"
    settings.write_text(
        f'preset = "seed-notebook"\ndata = "{data}"\nout = "{tmp_path / "run"}"\n'
        "[model]\nn_layers = 1\nn_heads = 2\nd_model = 16\nblock_size = 16\n"
        "[train]\nmax_steps = 3\nbatch_size = 4\nlr = 0.01\n"
        "grad_accum_steps = 2\n",
        encoding="utf-8",
    )
    assert main(["train", "--config", str(settings), "--max-steps", "5", "--no-progress"]) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["preset"] == "seed-notebook" and config["model"]["n_layers"] == 1
    assert config["train"]["max_steps"] == 5 and config["train"]["lr"] == 0.01  # flag wins
    assert config["train"]["grad_accum_steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records[-1]["tokens"] == 5 * 4 * 2 * 16  # steps * batch * accumulation * T

    for text, message in (
        ("[train]\nmax_step = 3\n", "unknown setting 'train.max_step'"),
        ("max_steps = 3\n", "unknown setting 'max_steps'"),
        ("[model\n", "does not parse"),
        (
            "[train]\ndtype = 'float8'\n",
            "--dtype: expected one of auto, float32, bfloat16, float16, f32, bf16, f16, fp32, fp16",
        ),
    ):
        settings.write_text(text, encoding="utf-8")
        assert main(["train", "--config", str(settings), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("decoderlm: error:") and message in err, err


def test_settings_with_wrong_types_and_options_that_do_not_apply(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    prepare([data], "byte", tmp_path / "tokens", log=quiet)
    settings = tmp_path / "run.toml"
    for text, message in (
        ("data = 5\n", "--data: expected a non-empty string or none, got '5'"),
        ("max_chars = 'abc'\n", "--max-chars: expected an integer >= 0"),
        ("[train]\nsample_prompt = 5\n", "--sample-prompt: expected text"),
        ("[train]\nlr = 'fast'\n", "--lr: expected a number, got 'fast'"),
        ("train = 5\n", "`train` in the settings file must map fields"),
    ):
        settings.write_text(text, encoding="utf-8")
        assert main(["train", "--config", str(settings), "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert f"--config {tmp_path} is a directory" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "--data",
                str(tmp_path / "tokens"),
                "--max-chars",
                "100",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert "do not apply to a prepared token directory" in capsys.readouterr().err


def test_unusable_settings_files_are_one_line_errors_whatever_flags_come_with_them(
    tmp_path, capsys
):
    files = {
        "binary.yaml": (b"\xff\xfe bad bytes\n", "is not UTF-8 text"),
        "empty.yaml": (b"", "is empty"),
        "list.yaml": (b"[1, 2]\n", "holds a list"),
        "model-list.yaml": (b"model:\n  - n_layers: 2\n", "`model` in the settings file"),
        "train-number.yaml": (b"train: 5\n", "`train` in the settings file"),
    }
    for name, (content, message) in files.items():
        path = tmp_path / name
        path.write_bytes(content)
        # a flag of the same section must not hide the file's mistake
        argv = ["train", "--config", str(path), "--dropout", "0.1", "--max-steps", "3"]
        err = one_line_error(capsys, argv + ["--out", str(tmp_path / "run")], message)
        assert str(path) in err
    assert not (tmp_path / "run").exists()


def test_abbreviated_flags_are_refused(tmp_path, capsys):
    # --over must never act as --overwrite
    one_line_error(capsys, ["train", "--over", "--out", str(tmp_path / "r")], "--over")
    one_line_error(capsys, ["train", "--max-step", "5", "--out", str(tmp_path / "r")], "--max-step")
    assert not (tmp_path / "r").exists()


# --- one vocabulary everywhere -----------------------------------------------------------------


def test_version(capsys):
    import decoderlm

    with pytest.raises(SystemExit) as exit_:
        parse(["--version"])
    assert exit_.value.code == 0
    capsys.readouterr()
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"decoderlm {decoderlm.__version__}"


@pytest.mark.parametrize(
    "short,long",
    [
        ("f32", "float32"),
        ("bf16", "bfloat16"),
        ("f16", "float16"),
        ("fp32", "float32"),
        ("fp16", "float16"),
    ],
)
def test_dtype_names_are_the_same_in_params_and_train(capsys, short, long):
    from decoderlm.config import TrainConfig

    reports = []
    for name in (short, long):
        assert main(["params", "--preset", "default", "--dtype", name, "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0] == reports[1] and reports[0]["dtype"] == long
    dtypes = [TrainConfig.from_dict({"dtype": name}).compute.dtype for name in (short, long)]
    assert dtypes == [long, long]
    for name in (short, long):
        settings = parse(["train", "--dtype", name])[1]
        assert settings["train_overrides"]["dtype"] == name  # accepted by train's parser
    with pytest.raises(ValueError, match="dtype must be one of"):
        TrainConfig.from_dict({"dtype": "fp8"})


def test_model_config_reads_yaml_json_and_toml(tmp_path, capsys):
    fields = tiny_model().config.to_dict()
    (tmp_path / "m.json").write_text(json.dumps(fields))
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"model": fields}))
    toml = "".join(
        f"{k} = {json.dumps(v) if not isinstance(v, bool) else str(v).lower()}\n"
        for k, v in fields.items()
        if v is not None
    )
    (tmp_path / "m.toml").write_text(toml)
    reports = []
    for name in ("m.json", "m.yaml", "m.toml"):
        assert main(["params", "--model-config", str(tmp_path / name), "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0]["config"] == fields and reports[0] == reports[1] == reports[2]
    # and --config itself, in TOML, for params as for train
    (tmp_path / "p.toml").write_text(f'model_config = "{tmp_path / "m.toml"}"\njson = true\n')
    assert main(["params", "--config", str(tmp_path / "p.toml")]) == 0
    assert json.loads(capsys.readouterr().out) == reports[0]
    (tmp_path / "bad.toml").write_text("n_layers = [")
    one_line_error(
        capsys, ["params", "--model-config", str(tmp_path / "bad.toml")], "does not parse"
    )


def test_a_prompt_file_or_text_file_that_is_missing_or_a_directory_is_named_with_its_flag(
    tmp_path, capsys
):
    run = byte_run(tmp_path / "run")
    for command, flag in (("sample", "--prompt-file"), ("inspect", "--text-file")):
        argv = [command, "--run", str(run), flag]
        one_line_error(capsys, [*argv, str(tmp_path / "no.txt")], f"{flag} {tmp_path / 'no.txt'}")
        one_line_error(capsys, [*argv, str(tmp_path)], f"{flag} {tmp_path} is a directory")


# --- a bug is not a user's mistake ---------------------------------------------------------


def test_an_internal_error_in_a_command_shows_its_traceback_and_exits_1(monkeypatch):
    # an error that is not a UserError (here a RuntimeError, as from torch) is a bug: the
    # command keeps its traceback and does not exit 2, the status of a user's mistake
    script = (
        "import sys\n"
        "import decoderlm.counts as counts\n"
        "def broken(config):\n"
        "    raise RuntimeError('broken on purpose')\n"
        "counts.count_parameters = broken\n"
        "from decoderlm.cli import main\n"
        "sys.exit(main(['params', '--preset', 'default']))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    assert "Traceback" in result.stderr and "RuntimeError: broken on purpose" in result.stderr
    assert "decoderlm: error" not in result.stderr
    # a plain ValueError is a bug too: main() raises it rather than printing one line
    import decoderlm.counts as counts

    def wrong(config):
        raise ValueError("not a user's mistake")

    monkeypatch.setattr(counts, "count_parameters", wrong)
    with pytest.raises(ValueError, match="not a user's mistake"):
        main(["params", "--preset", "default"])


# --- flags from a function's signature ------------------------------------------------------


@dataclass
class Optim:
    """How the test settings optimise."""

    lr: float = 1e-3
    """peak learning rate."""
    warmup: NonNegativeInt = 0
    """warm-up steps."""


@dataclass
class Settings:
    """Settings of a test command, with a nested section.

    Attributes:
        seed: the seed.
        optim: the optimiser's settings.
        tags: labels; repeat the flag.
    """

    seed: int = 1
    optim: Optim = field(default_factory=lambda: Optim(lr=0.5))
    tags: list[Literal["a", "b"]] = field(default_factory=list)


def command(
    n: PositiveInt,
    name: NotEmptyStr | None = None,
    settings: Annotated[dict[str, Any] | None, Fields(Settings, "settings")] = None,
    *,
    log=print,
) -> int:
    """Run a test command.

    What it does, at length.

    Args:
        n: how many.
        name: what to call it.
        settings: Settings fields to change.
    """
    return 0


def test_nested_dataclass_fields_are_flat_flags_with_their_own_help(tmp_path):
    parsed = command_flags("decoderlm t", command, {"name": "TEXT"}, {})
    text = parsed.parser.format_help()
    assert "What it does, at length." in text and "--name TEXT" in text
    assert "usage: decoderlm t [-h] [--config FILE] --n N [--name TEXT]" in text  # --n required
    for flag, help in (("--seed SEED", "the seed."), ("--lr LR", "peak learning rate.")):
        assert flag in text and help in text, (flag, text)
    assert "(default: 0.5)" in text  # the nested default of the parent's default, not Optim()'s
    assert "settings settings (Optim):" in text and "How the test settings optimise." in text
    assert "--optim" not in text and "--log" not in text  # a section; a Python-only parameter
    argv = ["--n", "3", "--lr", "0.25", "--tags", "a", "--tags", "b", "--name", "x"]
    assert parsed.parse(argv) == {"n": 3, "name": "x", "settings": {"lr": 0.25, "tags": ["a", "b"]}}
    (tmp_path / "s.yaml").write_text("n: 2\nsettings:\n  warmup: 4\n  seed: 7\n")
    assert parsed.parse(["--config", str(tmp_path / "s.yaml"), "--seed", "8"]) == {
        "n": 2,
        "settings": {"warmup": 4, "seed": 8},  # the flag wins
    }
    for argv, message in (
        ([], "the following arguments are required: --n"),
        (["--n", "0"], "argument --n: expected an integer > 0, got '0'"),
        (["--n", "1", "--warmup", "-1"], "argument --warmup: expected an integer >= 0"),
        (["--n", "1", "--name", ""], "expected a non-empty string or none, got ''"),
        (["--n", "1", "--tags", "c"], "argument --tags: expected one of a, b, got 'c'"),
        (["--n", "1", "--log", "x"], "unrecognized arguments: --log x"),
    ):
        with pytest.raises(FlagError, match=re.escape(message)):
            parsed.parse(argv)
    (tmp_path / "s.yaml").write_text("n: 2\nsettings:\n  optim: {lr: 1}\n")
    with pytest.raises(UserError, match="unknown setting 'settings.optim'"):
        parsed.parse(["--config", str(tmp_path / "s.yaml")])


@pytest.mark.parametrize(
    "hint,text,value",
    [
        (bool, "True", True),
        (float, "1e-3", 1e-3),
        (int | None, "none", None),
        (int | str | None, "4", 4),
        (int | str | None, "auto", "auto"),
        (Literal["x", "y"] | None, "y", "y"),
        (NotEmptyPath, "a/b", "a/b"),
    ],
)
def test_flag_values_are_converted_by_their_type(hint, text, value):
    assert convert(hint, text) == value


@pytest.mark.parametrize(
    "hint,value",
    [(float, "nan"), (float, "inf"), (int, "1.5"), (bool, "maybe"), (str, 5), (int, True)],
)
def test_values_a_type_does_not_take_are_refused(hint, value):
    with pytest.raises(ValueError):
        convert(hint, value)


# --- option groups shared by commands (decoderlm.options) -----------------------------------


@dataclass(frozen=True)
class Source:
    """Where a test command reads from.

    Attributes:
        path: the file to read.
        strict: refuse what looks wrong.
    """

    path: str | None = None
    strict: bool = False

    def __post_init__(self):
        if self.path == "":
            raise UserError("--path must not be empty")


def grouped(source: Annotated[Source, Fields(Source)] = Source(), n: PositiveInt = 1) -> int:
    """Run a test command with an option group.

    Args:
        source: where it reads from.
        n: how many.
    """
    return 0


def test_a_group_without_a_section_is_the_commands_own_flags_and_passes_its_dataclass(tmp_path):
    parsed = command_flags("decoderlm g", grouped, {"path": "FILE"}, {})
    text = " ".join(parsed.parser.format_help().split())
    assert "[--path FILE] [--strict [true|false]] [--n N]" in text  # in the parameter's place
    assert "the file to read." in text and "settings (Source)" not in text  # no group of its own
    assert parsed.parse(["--path", "a", "--n", "2"]) == {"source": Source("a"), "n": 2}
    assert parsed.parse(["--n", "2"]) == {"n": 2}  # none given: the function's default
    (tmp_path / "s.yaml").write_text("path: b\nstrict: true\n")  # top-level keys, as its flags
    assert parsed.parse(["--config", str(tmp_path / "s.yaml"), "--path", "c"]) == {
        "source": Source("c", True)  # the flag wins
    }
    with pytest.raises(UserError, match="--path must not be empty"):  # the dataclass's check
        parsed.parse(["--path", ""])
    (tmp_path / "s.yaml").write_text("source:\n  path: b\n")
    with pytest.raises(UserError, match="unknown setting 'source'"):
        parsed.parse(["--config", str(tmp_path / "s.yaml")])


GROUPS = {  # the option groups of each command: the same flags, with the same help
    "ModelSource": ("sample", "serve", "inspect", "eval"),
    "Precision": ("sample", "serve", "inspect", "eval"),
    "Decoding": ("sample", "serve"),
}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_each_shared_option_is_the_same_flag_with_the_same_help_in_every_command(group):
    import dataclasses

    import decoderlm.options as options
    from decoderlm.cli import command

    names = [f.name for f in dataclasses.fields(getattr(options, group))]
    seen = {}
    for name in GROUPS[group]:
        actions = {a.dest: a for a in command(name).parser._actions}
        flags = {
            dest.split(".")[-1]: (a.option_strings, a.help, a.metavar, a.choices)
            for dest, a in actions.items()
            if dest.split(".")[-1] in names and "." in dest
        }
        assert sorted(flags) == sorted(names), (name, flags)
        seen[name] = flags
    first = seen[GROUPS[group][0]]
    assert all(flags == first for flags in seen.values()), seen
    assert first["dtype" if group != "ModelSource" else "run"][1]  # documented


def test_sample_reads_its_model_and_decoding_from_a_settings_file(tmp_path, capsys):
    run = str(Path(__file__).parent / "fixtures" / "run_v0" / "gpt2-style")
    settings = tmp_path / "s.yaml"
    settings.write_text(f"run: {run}\ndtype: bf16\nprompt: [ab]\nmax_new_tokens: 6\n")
    argv = ["sample", "--config", str(settings), "--temperature", "0"]
    name, kwargs = parse(argv)
    assert kwargs["source"].run == run and kwargs["decoding"].dtype == "bfloat16"
    assert main(argv) == 0
    from_file = capsys.readouterr().out
    flags = ["--run", run, "--dtype", "bfloat16", "--prompt", "ab", "--max-new-tokens", "6"]
    assert main(["sample", *flags, "--temperature", "0"]) == 0
    assert capsys.readouterr().out == from_file and from_file.startswith("ab")


def test_a_model_source_flag_replaces_the_settings_files_source(tmp_path):
    """--hf (or --gguf) on the command line replaces a settings file's `run`, as every flag
    overrides the file, rather than counting as a second source; the file's other settings
    stay."""
    settings = tmp_path / "s.yaml"
    settings.write_text("run: some/run\ndevice: cpu\nno_verify: true\n")
    _, kwargs = parse(["sample", "--config", str(settings), "--hf", "an/hf-dir"])
    source = kwargs["source"]
    assert (source.run, source.hf, source.no_verify) == (None, "an/hf-dir", True)
    _, kwargs = parse(["sample", "--config", str(settings), "--device", "cpu"])
    assert kwargs["source"].run == "some/run"  # a flag outside the alternatives keeps it


def test_a_renamed_flag_is_named_with_its_name_now(capsys):
    """export's --dtype is --outtype (llama.cpp's converter's name): the old flag is refused
    saying so, in one line; an unknown flag gets no such hint."""
    assert main(["export", "--run", "r", "--format", "gguf", "--out", "o", "--dtype", "f16"]) == 2
    err = capsys.readouterr().err
    assert "--dtype is now --outtype" in err and len(err.strip().splitlines()) == 1
    assert main(["export", "--run", "r", "--format", "gguf", "--out", "o", "--dtyp", "f16"]) == 2
    assert "is now" not in capsys.readouterr().err
