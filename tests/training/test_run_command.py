import json
import math
import subprocess
import sys

import pytest

from decoderlm import DecoderLM, load_tokenizer
from decoderlm.cli import main

from conftest import tiny_model

TEXT = (
    "The quick brown fox jumps over the lazy dog. " * 12
    + "Pack my box with five dozen liquor jugs.\n" * 4
)
SMALL = [
    "--n-layers",
    "1",
    "--n-heads",
    "2",
    "--d-model",
    "16",
    "--block-size",
    "16",
    "--batch-size",
    "4",
    "--max-steps",
    "6",
    "--eval-interval",
    "3",
    "--no-progress",
]


def train_small(tmp_path, *extra, expect: int = 0) -> tuple:
    """Train the SMALL model on TEXT into tmp_path/run; returns (data file, run dir)."""
    data = tmp_path / "tiny.txt"
    data.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *SMALL, *extra]) == expect
    return data, out


def test_train_writes_a_complete_run_and_sample_is_reproducible(tmp_path, capsys):
    data, out = train_small(tmp_path)
    printed = capsys.readouterr().out
    assert "final validation loss" in printed and "bits/char" in printed and str(out) in printed
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "metrics.jsonl",
        "loss.png",
        "attention.png",
        "samples.txt",
        "report.html",
        "report.json",
    ):
        assert (out / name).stat().st_size > 0, name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert all({"step", "train_loss", "lr"} <= set(r) for r in records)
    evals = [r for r in records if "val_loss" in r]  # the lens probe, one score per layer
    assert all(len(r["induction_score"]) == 1 and r["probe_second_half_loss"] > 0 for r in evals)
    assert len(json.loads((out / "report.json").read_text())["tokens"]) == 16
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["block_size"] == 16 and config["train"]["max_steps"] == 6
    tok = load_tokenizer(out)
    assert tok.chars == sorted(set(TEXT)) + ["\ufffd"] and tok.unk_token == "\ufffd"
    sample = (out / "samples.txt").read_text(encoding="utf-8")
    assert sample.startswith("T") and len(sample) == 601
    DecoderLM.from_pretrained(out)

    args = [
        "sample",
        "--run",
        str(out),
        "--prompt",
        "The ",
        "--max-new-tokens",
        "40",
        "--seed",
        "3",
        "--top-k",
        "5",
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and len(first) == 4 + 41  # prompt + 40 + "\n"
    assert main(args + ["--compile"]) == 0  # the same text, decoded by a compiled step
    assert capsys.readouterr().out == first
    # the run is never overwritten by accident
    assert main(["train", "--data", str(data), "--out", str(out), *SMALL]) == 2
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "--data", "/no/such/file.txt"], "not found"),
        (
            ["train", "--max-chars", "100", "--block-size", "64", "--no-progress"],
            "the validation split has 10 tokens",
        ),
        (["train", "--n-heads", "3", "--no-progress"], "divisible by n_heads"),
        (["sample", "--run", "/no/such/run"], "not found"),
        (["train", "--lr", "nan"], "--lr: expected a number, got 'nan'"),
        (["train", "--weight-decay", "-1"], "weight_decay must be a finite number"),
        (["train", "--max-steps", "0"], "max_steps must be a positive integer, got 0"),
        (["train", "--max-steps", "1.5"], "expected an integer, got '1.5'"),
        (["train", "--seed", "99999999999999999999"], "seed must be an integer >= 0 below"),
        (["train", "--compile", "maybe"], "expected true or false, got 'maybe'"),
        (["train", "--grad-clip", "x"], "expected a number or none, got 'x'"),
        (["train", "--resume", "/no/such/run"], "resume directory /no/such/run not found"),
        (["train", "--device", "meta"], "unknown device 'meta'"),
        (["train", "--out", ""], "empty string"),
        (["train", "--data", "."], "has no wiki.train.raw"),
        (["train", "--data", "empty.txt"], "is empty"),
        (
            ["train", "--data", "latin1.txt"],
            "invalid byte at offset 3); convert it to UTF-8, or train "
            "on its bytes: `decoderlm prepare --data FILE --tokenizer byte",
        ),
        (["sample", "--run", ".", "--temperature", "nan"], "--temperature: expected a number"),
        (["sample", "--run", ".", "--temperature", "0.5"], "not found"),
    ],
)
def test_user_mistakes_give_one_line_errors(tmp_path, capsys, args, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("decoderlm: error:") and message in err and "Traceback" not in err


def test_sample_with_unknown_characters_or_mismatched_tokenizer(tmp_path, capsys):
    # a prompt with characters outside the vocabulary names each one and its position; a
    # tokenizer whose size differs from the model's vocabulary is refused, never used
    data, out = train_small(tmp_path)
    capsys.readouterr()
    assert main(["sample", "--run", str(out), "--prompt", "Zebra!"]) == 2
    err = capsys.readouterr().err
    assert "'Z' at position 0" in err and "'!' at position 5" in err
    (out / "decoderlm_tokenizer.json").write_text(
        json.dumps({"type": "char", "chars": list("abc")})
    )
    assert main(["sample", "--run", str(out), "--prompt", "a"]) == 2
    assert "3 tokens but the model expects vocab_size=" in capsys.readouterr().err


def test_console_entry_point_runs_as_a_subprocess(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "decoderlm", "sample", "--run", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("decoderlm: error:") and "Traceback" not in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "decoderlm", "presets"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "seed-notebook" in result.stdout


def test_sample_into_a_closed_pipe_exits_0_quietly(tmp_path):
    # `decoderlm sample ... | head -c 10`: the reader goes away long before the sample ends
    from decoderlm import CharTokenizer

    tiny_model().save_pretrained(tmp_path)
    CharTokenizer([chr(c) for c in range(48, 48 + 65)]).save_pretrained(tmp_path)
    sample = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "decoderlm",
            "sample",
            "--run",
            str(tmp_path),
            "--prompt",
            "0",
            "--max-new-tokens",
            "20000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    head = subprocess.run(
        ["head", "-c", "10"], stdin=sample.stdout, capture_output=True, check=True
    )
    sample.stdout.close()  # only head holds the pipe's read end; it has exited
    err = sample.stderr.read().decode()
    assert sample.wait(timeout=60) == 0 and err == ""
    assert len(head.stdout) == 10


def test_argument_errors_are_one_line(capsys):
    assert main(["train", "--top-k", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("decoderlm: error: unrecognized arguments")


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    data = tmp_path / "tiny.txt"
    data.write_text(TEXT, encoding="utf-8")
    for out in ("afile", "afile/sub"):
        assert main(["train", "--data", str(data), "--out", str(tmp_path / out), *SMALL]) == 2
        assert "Traceback" not in capsys.readouterr().err


def test_an_existing_run_is_kept_unless_overwrite(tmp_path, capsys):
    data, out = train_small(tmp_path)
    before = (out / "model.safetensors").read_bytes()
    assert main(["train", "--data", str(data), "--out", str(out), *SMALL]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert (out / "model.safetensors").read_bytes() == before
    assert (
        main(
            ["train", "--data", str(data), "--out", str(out), "--overwrite", *SMALL, "--seed", "7"]
        )
        == 0
    )
    assert (out / "model.safetensors").read_bytes() != before
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2  # the old run is gone


def test_a_diverging_run_stops_with_a_message_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    data, out = train_small(
        tmp_path,
        "--checkpoint-interval",
        "1",
        "--lr",
        "1e30",
        "--max-steps",
        "40",
        "--dtype",
        "float32",
        expect=2,
    )
    err = capsys.readouterr().err
    assert "the training loss became" in err and "last good checkpoint" in err
    good = err.split("last good checkpoint is ")[1].strip()
    from decoderlm.training.checkpoints import load_trainer_state

    state = load_trainer_state(good)
    assert state["step"] >= 1 and math.isfinite(state["loss_sum"])
    assert not (out / "model.safetensors").exists()


def test_damaged_run_files_give_clear_errors(tmp_path, capsys):
    data, out = train_small(tmp_path)
    capsys.readouterr()
    weights = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(weights[:1000])
    assert main(["sample", "--run", str(out)]) == 2  # the recorded size tells first
    assert f"is 1,000 bytes but config.json records {len(weights):,}" in capsys.readouterr().err
    assert main(["sample", "--run", str(out), "--no-verify"]) == 2  # unchecked: unreadable
    assert "not a readable safetensors file" in capsys.readouterr().err
    (out / "model.safetensors").write_bytes(weights)
    for text, message in (("42", "has no 'model' entry"), ("\xff\xfe", "not valid UTF-8 JSON")):
        (out / "config.json").write_bytes(text.encode("latin-1"))
        assert main(["sample", "--run", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and "config.json" in err


def test_sample_several_prompts_samples_and_stop_text(tmp_path, capsys):
    data, out = train_small(tmp_path)
    capsys.readouterr()
    base = ["sample", "--run", str(out), "--max-new-tokens", "30", "--seed", "5", "--only-new"]
    assert main(base + ["--prompt", "The "]) == 0
    alone = capsys.readouterr().out
    # by default the prompt comes first, then its continuation (transformers, nanoGPT)
    assert main(base[:-1] + ["--prompt", "The "]) == 0
    assert capsys.readouterr().out == "The " + alone
    assert main(base[:-1] + ["--prompt", "The ", "--prompt", "Pack", "--num-samples", "2"]) == 0
    parts = capsys.readouterr().out.split("\n---\n")
    assert len(parts) == 4 and parts[0] == "### prompt 1 of 2, sample 1 of 2\nThe " + alone
    assert parts[3].startswith("### prompt 2 of 2, sample 2 of 2\nPack")
    (tmp_path / "prompts.txt").write_text("The \nPack\n", encoding="utf-8")
    assert main(base[:-1] + ["--prompt-file", str(tmp_path / "prompts.txt")]) == 0
    from_file = capsys.readouterr().out.split("\n---\n")
    assert from_file[0] == parts[0].replace(", sample 1 of 2", "")
    assert from_file[1] == parts[2].replace(", sample 1 of 2", "")
    stop = alone[5:7]  # two characters from the middle of the sample
    assert main(base + ["--prompt", "The ", "--stop", stop]) == 0
    cut = capsys.readouterr().out
    assert cut == alone[: alone.index(stop)] + "\n"
    assert main(base + ["--prompt", "The ", "--prompt", "Zz!"]) == 2  # checked before sampling
    captured = capsys.readouterr()
    assert captured.out == "" and "'!'" in captured.err


def test_prompt_file_with_bom_empty_file_and_blank_line(tmp_path, capsys):
    data, out = train_small(tmp_path)
    capsys.readouterr()
    base = ["sample", "--run", str(out), "--max-new-tokens", "5", "--seed", "1"]
    (tmp_path / "bom.txt").write_bytes("\ufeffThe \n".encode("utf-8"))
    assert main(base + ["--prompt-file", str(tmp_path / "bom.txt")]) == 0
    with_bom = capsys.readouterr().out
    assert main(base + ["--prompt", "The "]) == 0
    assert with_bom == capsys.readouterr().out
    (tmp_path / "empty.txt").write_text("")
    assert main(base + ["--prompt-file", str(tmp_path / "empty.txt")]) == 2
    assert "holds no prompts" in capsys.readouterr().err
    (tmp_path / "blank.txt").write_text("The \n\nPack\n")
    assert main(base + ["--prompt-file", str(tmp_path / "blank.txt")]) == 2
    assert "line 2 is empty" in capsys.readouterr().err


def test_the_wrote_line_lists_the_files_the_run_wrote(tmp_path, capsys):
    _, out = train_small(tmp_path, "--log", "csv")
    wrote = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    listed = wrote[0].split(": ", 1)[1].split()
    on_disk = [p.name + "/" if p.is_dir() else p.name for p in out.iterdir()]
    assert "metrics.csv" in listed and sorted(listed) == sorted(on_disk)
