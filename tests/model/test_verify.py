"""Weights verified on load: config.json records each weights file's sha256 and size; a file
changed in place (same size) or truncated is refused with one line naming it and both
digests or sizes; verify=False / --no-verify skips the check; directories that record no
checksums load as before."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from decoderlm import DecoderLM
from decoderlm.cli import main
from decoderlm.io.hf_gpt2 import load_gpt2, save_gpt2
from decoderlm.tokenizers import ByteTokenizer

from conftest import one_line_error, randomize, tiny_model

RUN_V0 = Path(__file__).parents[1] / "fixtures" / "run_v0" / "gpt2-style"


def flip_last_bytes(path) -> None:
    """Overwrite the last 4 bytes (tensor data, not the header) in place: same size."""
    with open(path, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        old = f.read(4)
        f.seek(-4, os.SEEK_END)
        f.write(bytes(b ^ 0x55 for b in old))


def byte_run(directory) -> Path:
    randomize(tiny_model(vocab_size=256)).save_pretrained(directory)
    ByteTokenizer().save_pretrained(directory)
    return Path(directory)


def test_config_records_the_sha256_and_size_of_the_weights(tmp_path):
    run = byte_run(tmp_path)
    data = (run / "model.safetensors").read_bytes()
    recorded = json.loads((run / "config.json").read_text())["checksums"]
    expected = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    assert recorded == {"model.safetensors": expected}


def test_bytes_changed_in_place_are_refused_unless_verify_is_off(tmp_path):
    run = byte_run(tmp_path)
    good = DecoderLM.from_pretrained(run)
    recorded = json.loads((run / "config.json").read_text())["checksums"]["model.safetensors"]
    flip_last_bytes(run / "model.safetensors")
    actual = hashlib.sha256((run / "model.safetensors").read_bytes()).hexdigest()
    with pytest.raises(ValueError) as error:
        DecoderLM.from_pretrained(run)
    message = str(error.value)
    for fragment in (str(run / "model.safetensors"), actual, recorded["sha256"], "--no-verify"):
        assert fragment in message, message
    assert "\n" not in message
    loaded = DecoderLM.from_pretrained(run, verify=False)  # the skip: it loads, and differs
    idx = torch.randint(0, 256, (1, 8))
    assert not torch.equal(loaded(idx)[0], good(idx)[0])


def test_a_truncated_file_is_refused_naming_both_sizes(tmp_path):
    run = byte_run(tmp_path)
    size = (run / "model.safetensors").stat().st_size
    with open(run / "model.safetensors", "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(ValueError, match=rf"is {size - 1000:,} bytes but config.json records "):
        DecoderLM.from_pretrained(run)
    with pytest.raises(ValueError, match="not a readable safetensors file"):  # unchecked
        DecoderLM.from_pretrained(run, verify=False)


def test_commands_stop_with_one_line_and_no_verify_skips(tmp_path, capsys):
    run = byte_run(tmp_path)
    flip_last_bytes(run / "model.safetensors")
    argv = ["sample", "--run", str(run), "--prompt", "ab", "--max-new-tokens", "3"]
    one_line_error(capsys, argv, "model.safetensors has sha256", "config.json records")
    assert main([*argv, "--no-verify"]) == 0
    capsys.readouterr()
    one_line_error(
        capsys, ["eval", "--run", str(run), "--data", str(run / "config.json")], "sha256"
    )
    html = str(tmp_path / "r.html")
    inspect = ["inspect", "--run", str(run), "--text", "abcdef", "--out", html]
    one_line_error(capsys, inspect, "sha256")
    assert main([*inspect, "--no-verify"]) == 0


def test_train_init_from_a_damaged_run_is_refused_unless_no_verify(tmp_path, capsys):
    run = byte_run(tmp_path / "src")
    flip_last_bytes(run / "model.safetensors")
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. " * 40, encoding="utf-8")
    argv = ["train", "--init-from", str(run), "--data", str(text), "--max-steps", "1"]
    argv += ["--batch-size", "2", "--eval-batches", "1", "--no-progress"]
    one_line_error(capsys, [*argv, "--out", str(tmp_path / "a")], "model.safetensors has sha256")
    assert main([*argv, "--out", str(tmp_path / "b"), "--no-verify"]) == 0


def test_a_gpt2_export_is_verified_and_transformers_directories_load_unchecked(tmp_path):
    model = randomize(tiny_model(vocab_size=101))
    save_gpt2(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["checksums"]["model.safetensors"]["size"] > 0
    idx = torch.randint(0, 101, (1, 8))
    assert (load_gpt2(tmp_path)(idx)[0] - model(idx)[0]).abs().max() < 1e-5
    flip_last_bytes(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors has sha256"):
        load_gpt2(tmp_path)
    load_gpt2(tmp_path, verify=False)
    del config["checksums"]  # as transformers' save_pretrained writes it
    (tmp_path / "config.json").write_text(json.dumps(config))
    load_gpt2(tmp_path)


def test_a_run_written_without_checksums_loads_with_the_same_logits():
    from safetensors.torch import load_file

    assert "checksums" not in json.loads((RUN_V0 / "config.json").read_text())
    expected = load_file(str(RUN_V0 / "expected.safetensors"))
    logits, _ = DecoderLM.from_pretrained(RUN_V0)(expected["idx"])
    torch.testing.assert_close(logits, expected["logits"], atol=1e-6, rtol=1e-6)
