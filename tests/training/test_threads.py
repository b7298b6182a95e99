"""--threads: parsing, a fixed count, and "auto" leaving the model and every RNG untouched."""

import contextlib

import pytest
import torch

from decoderlm.config import TrainConfig
from decoderlm.training.threads import parse_threads, set_threads, thread_candidates

from conftest import one_line_error, tiny_model


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_parse_threads_takes_auto_and_positive_integers_only(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert [parse_threads(v) for v in (None, "auto", "2", 3)] == [None, "auto", 2, 3]
    for bad in ("0", "-1", "two", True, 1.5):
        with pytest.raises(ValueError, match="--threads must be auto or a positive integer"):
            parse_threads(bad)
    with pytest.raises(ValueError, match="--threads 5 is more than this machine's 4 CPUs"):
        parse_threads("5")


def test_a_fixed_count_is_set():
    model = tiny_model()
    assert set_threads("1", model, TrainConfig(), None, contextlib.nullcontext) == 1
    assert torch.get_num_threads() == 1


def test_auto_picks_a_candidate_and_changes_no_weight_gradient_or_rng():
    model = tiny_model(dropout=0.1).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    lines = []
    data = torch.randint(0, 65, (500,), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig.from_dict({"batch_size": 2})
    chosen = set_threads("auto", model, cfg, data, contextlib.nullcontext, lines.append)
    assert chosen in thread_candidates() and torch.get_num_threads() == chosen
    assert len(lines) == 1 and lines[0].startswith(f"threads: auto chose {chosen}")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not model.training
    assert torch.equal(torch.get_rng_state(), rng)


def test_bad_threads_flag_is_one_line_before_anything_is_written(capsys, tmp_path):
    one_line_error(
        capsys, ["train", "--out", str(tmp_path / "run"), "--threads", "many"], "--threads"
    )
    assert not (tmp_path / "run").exists()


def test_tuner_moves_to_one_thread_when_a_core_gets_busy_and_back_when_it_is_free(monkeypatch):
    from decoderlm.training import threads as threads_module

    count = {"n": 2}
    monkeypatch.setattr(threads_module, "thread_candidates", lambda: [1, 2])
    monkeypatch.setattr(torch, "get_num_threads", lambda: count["n"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: count.update(n=n))
    messages = []
    tuner = threads_module.ThreadTuner(messages.append, window=10, probe_steps=5, every=100)
    quiet, busy = {1: 0.015, 2: 0.010}, {1: 0.020, 2: 0.040}  # step seconds by threads

    def run(steps, times):
        for _ in range(steps):
            tuner.step_done(times[count["n"]])

    run(50, quiet)
    assert count["n"] == 2 and not messages  # no slowdown: no probe yet
    run(30, busy)  # the slowdown is seen within a window, 1 thread is probed and kept
    assert count["n"] == 1 and "from 2 to 1" in messages[-1]
    run(60, busy)
    assert count["n"] == 1 and len(messages) == 1
    run(130, quiet)  # the periodic probe finds 2 threads faster again
    assert count["n"] == 2 and "from 1 to 2" in messages[-1]


def test_a_busy_machine_gets_one_line_suggesting_threads_and_a_quiet_one_none():
    from decoderlm.training.threads import busy_machine_hint

    def busy():
        return (5.0, 4.0, 3.0)

    def quiet():
        return (0.3, 0.2, 0.1)

    hint = busy_machine_hint(2, busy, cpus=2)
    assert "load average 5.0 on 2 CPUs" in hint and "\n" not in hint
    assert "--threads 1" in hint and "--threads auto" in hint
    assert busy_machine_hint(2, quiet, cpus=2) is None
    assert busy_machine_hint(1, busy, cpus=2) is None  # one thread waits for no other
    assert busy_machine_hint(8, lambda: (9.0, 0, 0), cpus=16) is not None  # 7 idle < 8 threads
    assert busy_machine_hint(8, lambda: (8.0, 0, 0), cpus=16) is None  # 8 idle: room for all

    def no_load_average():
        raise OSError("no load average")

    assert busy_machine_hint(2, no_load_average, cpus=2) is None


def test_train_says_when_the_machine_is_busy_and_keeps_the_default_threads(
    tmp_path, capsys, monkeypatch
):
    # a faked load reading: the default run prints the hint and trains exactly as a quiet one
    from test_run_command import train_small

    for name in ("quiet", "busy"):
        (tmp_path / name).mkdir()
    torch.set_num_threads(2)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (0.1, 0.1, 0.1))
    _, quiet = train_small(tmp_path / "quiet")
    assert "this machine is busy" not in capsys.readouterr().out
    monkeypatch.setattr("os.getloadavg", lambda: (5.0, 5.0, 5.0))
    _, busy = train_small(tmp_path / "busy")
    out = capsys.readouterr().out
    assert out.count("this machine is busy (load average 5.0 on 2 CPUs)") == 1
    assert torch.get_num_threads() == 2
    weights = "model.safetensors"
    assert (quiet / weights).read_bytes() == (busy / weights).read_bytes()


def test_decoding_commands_take_threads_as_train_does(monkeypatch):
    """sample, serve, eval and inspect take --threads N with train's one check (no auto:
    there are no training steps to time)."""
    from decoderlm.cli import parse

    monkeypatch.setattr("os.cpu_count", lambda: 4)
    for name in ("sample", "serve", "eval", "inspect"):
        _, kwargs = parse([name, "--run", "r", "--threads", "3"])
        assert kwargs["source"].threads == 3, name
    with pytest.raises(ValueError, match="--threads must be a positive integer, got 'auto'"):
        parse_threads("auto", auto=False)
    with pytest.raises(ValueError, match="--threads 5 is more than this machine's 4 CPUs"):
        parse(["eval", "--run", "r", "--threads", "5"])


@pytest.mark.parametrize("command", ["sample", "eval"])
def test_threads_is_set_before_the_model_computes(tmp_path, monkeypatch, capsys, command):
    from decoderlm.cli import main
    from decoderlm.model.weights import save_model
    from decoderlm.tokenizers import CharTokenizer

    text = "hello there, hello again. " * 20
    tok = CharTokenizer.from_text(text)
    save_model(tiny_model(vocab_size=tok.vocab_size), tmp_path / "run")
    tok.save_pretrained(tmp_path / "run")
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    torch.set_num_threads(2)
    seen, real = [], torch.nn.Module.__call__

    def call(module, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", call)
    extra = {"sample": ["--prompt", "he", "--max-new-tokens", "2"], "eval": ["--data", "text.txt"]}
    monkeypatch.chdir(tmp_path)
    assert main([command, "--run", "run", "--threads", "1", *extra[command]]) == 0
    assert seen and set(seen) == {1}
    one_line_error(capsys, [command, "--run", "run", "--threads", "0"], "--threads")
