"""Careless inputs of a newcomer get one line and exit 2, with nothing printed before it and
nothing written that was not asked for: a bad sampling setting, inspect's output file, a model
too large for memory."""

from pathlib import Path

import pytest

from decoderlm.cli import main
from decoderlm.config import ModelConfig
from decoderlm.errors import UserError
from decoderlm.model.analysis import out_of_memory_as_user_error
from decoderlm.presets import get_preset

from conftest import one_line_error

RUN = Path(__file__).parent / "fixtures" / "run_v0" / "gpt2-style"  # char model, block 16
TORCH_CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 40000000000000 bytes. Error code 12 (Cannot allocate memory)"
)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-1"], "error: --temperature must be a finite number >= 0"),
        (["--top-p", "1.5"], "error: --top-p must be in [0, 1]"),
        (["--top-k", "0"], "error: argument --top-k: expected an integer > 0"),
    ],
)
@pytest.mark.parametrize("command", [["sample", "--prompt", "The "], ["chat"]])
def test_a_bad_sampling_setting_is_refused_by_its_flag_before_anything_is_printed(
    capsys, command, flags, message
):
    argv = [*command, "--run", str(RUN), "--max-new-tokens", "3", *flags]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("decoderlm: error:") and captured.err.count("\n") == 1
    assert message in captured.err


def test_inspect_without_out_writes_report_html_here_once_and_never_replaces_it(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    argv = ["inspect", "--run", str(RUN), "--text", "The cat sat"]
    assert main(argv) == 0
    assert (tmp_path / "report.html").is_file() and "wrote report.html" in capsys.readouterr().out
    (tmp_path / "report.html").write_text("mine", encoding="utf-8")
    one_line_error(capsys, argv, "report.html is already in the current directory", "--out")
    assert (tmp_path / "report.html").read_text(encoding="utf-8") == "mine"
    assert main([*argv, "--out", "report.html"]) == 0  # named: replaced, as asked
    assert (tmp_path / "report.html").read_text(encoding="utf-8") != "mine"


def test_inspect_says_which_folder_it_made_for_out(tmp_path, capsys):
    out = tmp_path / "no" / "such" / "r.html"
    assert main(["inspect", "--run", str(RUN), "--text", "The cat", "--out", str(out)]) == 0
    assert f"(made the folder {out.parent})" in capsys.readouterr().out and out.is_file()


def test_torchs_allocation_failure_is_one_line_with_the_estimate():
    config = ModelConfig.from_dict(get_preset("gpt2").model)
    with pytest.raises(UserError) as e:
        with out_of_memory_as_user_error("build the model", config, batch_size=8):
            raise RuntimeError(TORCH_CPU_OOM)
    message = str(e.value)
    assert "not enough memory to build the model" in message and "\n" not in message
    assert "torch asked for 37,252.903 GiB" in message
    assert "the model's weights are 0.464 GiB" in message  # as `decoderlm params --preset gpt2`
    assert "training at batch size 8" in message and "enforce fail" not in message
    with pytest.raises(RuntimeError, match="another bug"):  # any other error is left alone
        with out_of_memory_as_user_error("build the model", config):
            raise RuntimeError("another bug")


def test_a_model_too_large_to_load_or_build_is_one_line(tmp_path, monkeypatch, capsys):
    import decoderlm.io.load as loader
    import decoderlm.training.run as run

    def out_of_memory(*args, **kwargs):
        raise RuntimeError(TORCH_CPU_OOM)

    monkeypatch.setattr(loader, "load_run", out_of_memory)
    one_line_error(
        capsys,
        ["sample", "--run", str(RUN), "--prompt", "The "],
        f"not enough memory to load the model of {RUN}",
        f"`decoderlm params --run {RUN}`",
    )
    monkeypatch.setattr(run, "_build_model", out_of_memory)
    argv = ["train", "--max-steps", "1", "--out", str(tmp_path / "r"), "--no-progress"]
    one_line_error(capsys, argv, "not enough memory to build the model", "training at batch")


def test_dataset_offline_is_one_line_at_once_without_the_hub_retries(tmp_path, monkeypatch, capsys):
    import socket
    import sys
    import types

    def unreachable(address, timeout=None):
        raise socket.gaierror(-2, "Name or service not known")

    def load_dataset(*args, **kwargs):
        raise AssertionError("datasets.load_dataset is not reached offline")

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    argv = ["train", "--dataset", "wikitext-2-raw-v1", "--out", str(tmp_path / "r")]
    one_line_error(capsys, argv, "--dataset needs the network", "huggingface.co:443", "--data")


def test_characters_outside_the_vocabulary_refuse_a_prompt_and_are_counted_in_a_score(
    tmp_path, capsys
):
    # the documented rule: text to continue is refused, naming the character; text to score
    # maps it to the unknown token and says how many it mapped
    one_line_error(capsys, ["sample", "--run", str(RUN), "--prompt", "Quite"], "'Q' at position 0")
    assert capsys.readouterr().out == ""
    text = tmp_path / "q.txt"
    text.write_text("Quite the cat sat on the mat. Quite.\n", encoding="utf-8")
    assert main(["eval", "--run", str(RUN), "--data", str(text)]) == 0
    assert "unknown characters: 2 (mapped to the unknown token" in capsys.readouterr().out
