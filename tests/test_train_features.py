"""Training settings from the command line: settings files with overrides, and settings
that are wrong or do not apply (exit 2 with a clear message)."""

import json

from decoderlm.cli import main
from decoderlm.prepare import prepare

TEXT = "".join(chr(33 + (i * 7919) % 60) for i in range(3000)) + " caf\u00e9 \u6771\u4eac\n" * 20


def quiet(*args, **kwargs):
    pass


def test_settings_file_then_command_line_overrides(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    settings = tmp_path / "run.toml"
    settings.write_text(f'preset = "seed-notebook"\ndata = "{data}"\nout = "{tmp_path / "run"}"\n'
                        "[model]\nn_layers = 1\nn_heads = 2\nd_model = 16\nblock_size = 16\n"
                        "[train]\nmax_steps = 3\nbatch_size = 4\nlr = 0.01\n"
                        "grad_accum_steps = 2\n", encoding="utf-8")
    assert main(["train", "--config", str(settings), "--max-steps", "5", "--no-progress"]) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["preset"] == "seed-notebook" and config["model"]["n_layers"] == 1
    assert config["train"]["max_steps"] == 5 and config["train"]["lr"] == 0.01  # flag wins
    assert config["train"]["grad_accum_steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records[-1]["tokens"] == 5 * 4 * 2 * 16  # steps * batch * accumulation * T

    for text, message in (("[train]\nmax_step = 3\n", "unknown setting 'train.max_step'"),
                          ("max_steps = 3\n", "unknown setting 'max_steps'"),
                          ("[model\n", "does not parse"),
                          ("[train]\ndtype = 'float8'\n",
                           "--dtype: expected one of float32, bfloat16, float16")):
        settings.write_text(text, encoding="utf-8")
        assert main(["train", "--config", str(settings), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("decoderlm: error:") and message in err, err


def test_settings_with_wrong_types_and_options_that_do_not_apply(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    prepare([data], "byte", tmp_path / "tokens", log=quiet)
    settings = tmp_path / "run.toml"
    for text, message in (("data = 5\n", "--data: expected a non-empty string or none, got '5'"),
                          ("max_chars = 'abc'\n", "--max-chars: expected an integer >= 0"),
                          ("[train]\nsample_prompt = 5\n", "--sample-prompt: expected text"),
                          ("[train]\nlr = 'fast'\n", "--lr: expected a number, got 'fast'"),
                          ("train = 5\n", "`train` in the settings file must map fields")):
        settings.write_text(text, encoding="utf-8")
        assert main(["train", "--config", str(settings), "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "--config: Path is not a file" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "tokens"), "--max-chars", "100",
                 "--out", str(tmp_path / "x")]) == 2
    assert "do not apply to a prepared token directory" in capsys.readouterr().err
