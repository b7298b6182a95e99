"""Checkpoints and exact resume (TrainState): stop and resume, SIGKILL / SIGTERM / SIGINT, the
float16 loss scaler, weights-only loading, torn writes.

Every run here is the TINY model (vocab 65, block 32, 2 layers, 4 heads,
d_model 64) on a fixed 2,000-character corpus of 65 symbols, float32 on the CPU, with dropout
so that the torch RNG state matters too. The oracle is an uninterrupted run of the same
settings: a resumed run must log the same losses and end with the same weights, bit for bit.
"""

import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from decoderlm import DecoderLM
from decoderlm.cli import main
from decoderlm.config import TrainConfig
from decoderlm.model.weights import list_checkpoints
from decoderlm.training import loop
from decoderlm.training.checkpoints import load_trainer_state
from decoderlm.training.loop import micro_batches, train_step
from decoderlm.training.optim import configure_optimizer, lr_at
from decoderlm.training.parallel import DistInfo, Parallelized
from decoderlm.training.state import TrainState, named_state_dicts

from conftest import one_line_error, tiny_config

SYMBOLS = [chr(c) for c in range(33, 33 + 64)] + ["\n"]  # 65 distinct characters
TINY = [  # AdamW (the 'classic' preset): these tests read AdamW's state
    "--preset",
    "classic",
    "--n-layers",
    "2",
    "--n-heads",
    "4",
    "--d-model",
    "64",
    "--block-size",
    "32",
    "--dropout",
    "0.1",
    "--batch-size",
    "4",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--warmup-steps",
    "5",
    "--schedule",
    "cosine",
    "--dtype",
    "float32",
    "--seed",
    "0",
    "--log-interval",
    "1",
    "--eval-interval",
    "5",
    "--eval-batches",
    "2",
    "--no-progress",
    "--sample-chars",
    "10",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """In-process runs use one thread, like the subprocesses (ENV): float sums depend on the
    thread count, and the oracle must compute exactly what the resumed runs compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.arange(65), torch.randint(0, 65, (2000 - 65,), generator=g)])
    path = tmp_path_factory.mktemp("corpus") / "tiny2000.txt"
    path.write_text("".join(SYMBOLS[i] for i in ids.tolist()), encoding="utf-8")
    return path


def cli(*args, background=False):
    """Run `python -m decoderlm ...` in a new process (one thread)."""
    command = [sys.executable, "-m", "decoderlm", *map(str, args)]
    if background:
        return subprocess.Popen(
            command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)


def train_argv(data, out, *flags):
    """`decoderlm train` of the TINY model on `data` into `out`, then `flags`."""
    return ["train", "--data", str(data), "--out", str(out), *TINY, *flags]


def records(run_dir):
    """metrics.jsonl without the wall-clock fields (mfu is tokens_per_s times a constant)."""
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if k not in ("elapsed_s", "tokens_per_s", "mfu")}
        for line in lines
    ]


def weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def assert_same_run(a, b):
    assert records(a) == records(b)  # every logged loss, lr and val_loss, bit for bit
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    """Run A: 20 steps, cosine to 1e-4 by step 20."""
    out = tmp_path_factory.mktemp("a") / "run"
    assert main(train_argv(corpus, out, "--max-steps", "20", "--decay-steps", "20")) == 0
    return out


def test_stop_after_10_steps_and_resume_in_a_new_process_is_exact(corpus, uninterrupted, tmp_path):
    # run B trains 10 steps, saves, and resumes in a new process
    out = tmp_path / "run"
    first = cli(
        "train", "--data", corpus, "--out", out, *TINY, "--max-steps", "10", "--decay-steps", "20"
    )
    assert first.returncode == 0, first.stderr
    state = load_trainer_state(list_checkpoints(out)[-1])
    assert state["step"] == 10
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {10.0}
    second = cli("train", "--resume", out, "--max-steps", "20")
    assert second.returncode == 0, second.stderr
    assert "resuming from" in second.stdout
    cfg = TrainConfig.from_dict(
        dict(lr=1e-3, min_lr=1e-4, warmup_steps=5, schedule="cosine", max_steps=20)
    )
    assert records(out)[10]["lr"] == lr_at(10, cfg)  # the first resumed step's lr
    assert_same_run(uninterrupted, out)
    end_a = load_trainer_state(list_checkpoints(uninterrupted)[-1])
    end_b = load_trainer_state(list_checkpoints(out)[-1])
    assert torch.equal(end_a["data_sampler"], end_b["data_sampler"])  # the same batches


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_a_killed_or_terminated_run_resumes_exactly(corpus, tmp_path, how):
    steps = ["--max-steps", "400", "--checkpoint-interval", "3", "--eval-interval", "50"]
    reference = tmp_path / "reference"
    assert main(train_argv(corpus, reference, *steps)) == 0
    out = tmp_path / "run"
    proc = cli("train", "--data", corpus, "--out", out, *TINY, *steps, background=True)
    deadline = time.monotonic() + 120
    while not list_checkpoints(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(how)
    stdout, stderr = proc.communicate(timeout=120)
    assert not (out / "model.safetensors").exists(), "the run ended before the signal"
    if how == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:  # a checkpoint, a message, exit status 0
        assert proc.returncode == 0, stderr
        assert "checkpoint saved" in stdout and f"--resume {out}" in stdout
    stopped_at = load_trainer_state(list_checkpoints(out)[-1])["step"]
    assert 0 < stopped_at < 400
    resumed = cli("train", "--resume", out)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_run(reference, out)


def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one(
    corpus, tmp_path, monkeypatch, capsys
):
    import decoderlm.files as ckpt

    real_save, calls = torch.save, []

    def torn_save(obj, path):  # the second checkpoint dies half-way through its file
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04 half a zip")
            raise OSError("No space left on device")
        real_save(obj, path)

    monkeypatch.setattr(ckpt.torch, "save", torn_save)
    out = tmp_path / "run"
    args = train_argv(corpus, out, "--max-steps", "4", "--checkpoint-interval", "1")
    assert main(args) == 2
    assert "No space left on device" in capsys.readouterr().err
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(out)] == ["step-00000001"]
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert load_trainer_state(list_checkpoints(out)[0])["step"] == 1
    assert main(["train", "--resume", str(out)]) == 0
    reference = tmp_path / "reference"
    assert (
        main(train_argv(corpus, reference, "--max-steps", "4", "--checkpoint-interval", "1")) == 0
    )
    assert_same_run(reference, out)


def test_damaged_and_missing_checkpoints_give_clear_errors(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    base = train_argv(corpus, out, "--checkpoint-interval", "2", "--keep-checkpoints", "3")
    assert main([*base, "--max-steps", "4"]) == 0
    capsys.readouterr()
    newest = list_checkpoints(out)[-1] / "trainer_state.pt"
    newest.write_bytes(newest.read_bytes()[:300])  # truncated
    with pytest.raises(ValueError, match="is 300 bytes but config.json records"):
        load_trainer_state(newest.parent)  # the recorded size tells first
    with pytest.raises(ValueError, match="cannot be loaded safely"):
        load_trainer_state(newest.parent, verify=False)
    assert main(["train", "--resume", str(out), "--max-steps", "6"]) == 0
    captured = capsys.readouterr()
    assert "skipping checkpoint" in captured.out and "step-00000002" in captured.out

    weights = list_checkpoints(out)[-1] / "model.safetensors"  # now step 6
    weights.write_bytes(weights.read_bytes()[:500])
    assert main(["train", "--resume", str(out), "--max-steps", "8"]) == 0
    captured = capsys.readouterr()
    assert "is 500 bytes but config.json records" in captured.out
    assert "step-00000006" in captured.out

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "--resume", str(empty)]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    assert main(["train", "--resume", str(out), "--n-layers", "3", "--max-steps", "9"]) == 2
    err = capsys.readouterr().err
    assert "does not match the command line" in err and "n_layers is 2" in err
    assert main(["train", "--resume", str(out), "--max-steps", "8"]) == 2
    assert "pass a larger --max-steps" in capsys.readouterr().err
    assert main(["train", "--resume", str(out), "--overwrite"]) == 2
    assert "pick one" in capsys.readouterr().err


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_is_bfloat16_only_on_a_cpu_that_multiplies_it_natively_and_is_stored(
    corpus, tmp_path, capsys, monkeypatch, native
):
    monkeypatch.setattr(loop, "native_bfloat16", lambda: native)
    out, chosen = tmp_path / "run", "bfloat16" if native else "float32"
    assert main([*train_argv(corpus, out, "--dtype", "auto"), "--max-steps", "2"]) == 0
    assert f"2 steps, {chosen} on cpu" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["train"]["dtype"] == chosen
    # resumed on a CPU of the other kind, the run keeps the format it started in
    monkeypatch.setattr(loop, "native_bfloat16", lambda: not native)
    assert main(["train", "--resume", str(out), "--max-steps", "3"]) == 0
    assert f"3 steps, {chosen} on cpu" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_loss_scaler_only_for_float16_and_saved_with_the_checkpoint(corpus, tmp_path, dtype):
    out = tmp_path / "run"
    args = train_argv(corpus, out, "--dtype", dtype)
    assert main([*args, "--max-steps", "5", "--decay-steps", "7"]) == 0
    state = load_trainer_state(list_checkpoints(out)[-1])
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {5.0}
    if dtype != "float16":
        assert state["scaler"] == {}
        return
    assert state["scaler"]["scale"] == 65536.0 and state["scaler"]["_growth_tracker"] == 5
    assert main(["train", "--resume", str(out), "--max-steps", "7"]) == 0
    after = load_trainer_state(list_checkpoints(out)[-1])["scaler"]
    # restored, not restarted: the growth tracker went on counting from 5
    assert after["_growth_tracker"] == 7 and after["scale"] == 65536.0


def test_checkpoints_load_with_weights_only_and_unsafe_pickles_are_refused(corpus, tmp_path):
    out = tmp_path / "run"
    assert main(train_argv(corpus, out, "--max-steps", "2")) == 0
    checkpoint = list_checkpoints(out)[-1]
    plain = torch.load(checkpoint / "trainer_state.pt", weights_only=True)  # (a)
    assert isinstance(plain["train"], dict) and isinstance(plain["loss_sum"], float)
    assert json.loads((checkpoint / "config.json").read_text())["model"]["n_layers"] == 2

    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"step": 1, "payload": Exploit()}, checkpoint / "trainer_state.pt")  # (b)
    with pytest.raises(ValueError, match="trainer_state.pt .* config.json records"):
        load_trainer_state(checkpoint)  # not the file the checkpoint recorded
    with pytest.raises(ValueError, match="cannot be loaded safely"):
        load_trainer_state(checkpoint, verify=False)  # and unchecked, never unpickled
    assert not marker.exists()


def test_overwrite_deletes_only_the_earlier_run_and_only_once_settings_are_valid(
    corpus, tmp_path, capsys
):
    out = tmp_path / "run"
    base = train_argv(corpus, out, "--max-steps", "2")
    assert main(base) == 0
    (out / "notes.txt").write_text("mine")
    (out / "mine").mkdir()
    before = (out / "model.safetensors").read_bytes()
    assert main([*base, "--overwrite", "--fsdp"]) == 2  # refused before anything is deleted
    assert "--fsdp false" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before
    assert main([*base, "--overwrite", "--seed", "5"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "mine").is_dir()
    assert (out / "model.safetensors").read_bytes() != before
    assert main(["train", "--resume", str(out), "--out", str(tmp_path / "other")]) == 2
    assert "drop --out" in capsys.readouterr().err


def test_resume_notices_changed_data_and_accepts_moved_data(corpus, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_bytes(corpus.read_bytes())
    out = tmp_path / "run"
    assert main(train_argv(text, out, "--max-steps", "2", "--decay-steps", "4")) == 0
    text.write_text(text.read_text()[:1500])
    assert main(["train", "--resume", str(out), "--max-steps", "3"]) == 2
    assert "is not the one the checkpoint was trained on" in capsys.readouterr().err
    moved = tmp_path / "moved.txt"
    moved.write_bytes(corpus.read_bytes())
    assert main(["train", "--resume", str(out), "--max-steps", "3", "--data", str(moved)]) == 0
    assert "note: the cosine schedule" not in capsys.readouterr().out
    assert (
        main(
            [
                "train",
                "--resume",
                str(out),
                "--max-steps",
                "4",
                "--data",
                str(moved),
                "--val-fraction",
                "0.5",
            ]
        )
        == 2
    )
    assert "val_fraction is 0.1 in the checkpoint" in capsys.readouterr().err


def test_resume_finishes_a_run_stopped_after_its_last_step_and_survives_damage(
    corpus, tmp_path, capsys
):
    out = tmp_path / "run"
    args = train_argv(
        corpus, out, "--max-steps", "4", "--checkpoint-interval", "1", "--keep-checkpoints", "2"
    )
    assert main(args) == 0
    complete = {name: (out / name).read_bytes() for name in ("model.safetensors", "metrics.jsonl")}
    for name in ("model.safetensors", "config.json", "samples.txt"):
        (out / name).unlink()  # as if killed during the final evaluation
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "train_lo')  # and a line torn by the crash
    assert main(["train", "--resume", str(out)]) == 0
    assert (out / "model.safetensors").read_bytes() == complete["model.safetensors"]
    assert records(out) == [
        {k: v for k, v in json.loads(line).items() if k not in ("elapsed_s", "tokens_per_s", "mfu")}
        for line in complete["metrics.jsonl"].decode().splitlines()
    ]
    capsys.readouterr()
    (list_checkpoints(out)[-1] / "decoderlm_tokenizer.json").write_text("{")  # step 4 damaged
    assert main(["train", "--resume", str(out), "--max-steps", "6"]) == 0
    said = capsys.readouterr().out
    assert "skipping checkpoint" in said
    # the warning says what was done with the folder, not to delete what is already aside
    assert f"moved it to {out / 'checkpoints' / 'damaged-step-00000004'}" in said
    assert "by deleting" not in said
    # the damaged one is kept aside, out of the rotation; the two newest good ones remain
    assert [p.name for p in list_checkpoints(out)] == ["step-00000005", "step-00000006"]
    assert (out / "checkpoints" / "damaged-step-00000004").is_dir()


def test_train_state_round_trip_continues_exactly():
    """state_dict() after two steps, loaded into another model's TrainState, continues with
    the same losses and weights as the original: model, optimizer, window generator and
    dropout RNG all come back."""
    cfg = TrainConfig.from_dict(dict(batch_size=2, max_steps=4, lr=1e-3, dtype="float32"))
    data = torch.randint(0, 65, (500,), generator=torch.Generator().manual_seed(0))

    def new_state(seed):
        torch.manual_seed(seed)
        model = DecoderLM(tiny_config(dropout=0.1)).train()
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        generator = torch.Generator().manual_seed(cfg.data.seed)
        optimizer = configure_optimizer(model, cfg)
        return TrainState(model, optimizer, scaler, generator, cfg, DistInfo())

    def steps(state, n):
        par = Parallelized(state.model, state.model.device, state.model)
        losses = []
        for _ in range(n):
            batches = micro_batches(data, state.generator, cfg, state.info, 32)
            losses.append(train_step(par, state.optimizer, state.scaler, batches, cfg).item())
            state.add_loss(losses[-1])
        return losses

    a = new_state(0)
    steps(a, 2)
    saved = copy.deepcopy(a.state_dict())
    expected = steps(a, 2)
    b = new_state(1)
    b.load_state_dict(saved)
    assert b.step == 2 and steps(b, 2) == expected
    for name, value in a.model.state_dict().items():
        assert torch.equal(b.model.state_dict()[name], value), name


def _same_nested(a, b, where="") -> None:
    """a and b have the same structure, keys and values (tensors equal, same dtype)."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _same_nested(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same_nested(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.parametrize(
    "optimizer,checkpointing,freeze",
    [("adamw", False, None), ("muon", True, None), ("adamw", False, "embeddings")],
)
def test_one_process_state_dicts_are_those_of_torch_distributed_checkpoint(
    optimizer, checkpointing, freeze
):
    """The one-process checkpoint format written without torch.distributed.checkpoint is
    exactly what its get_state_dict(full_state_dict=True, cpu_offload=True) returns (tied
    unembedding, activation-checkpoint wrappers, Muon + AdamW groups, frozen weights)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from decoderlm.finetune.trainable import prepare_trainable
    from decoderlm.training.parallel import apply_activation_checkpointing

    cfg = TrainConfig.from_dict(
        dict(batch_size=2, lr=1e-3, dtype="float32", optimizer=optimizer, freeze=freeze)
    )
    torch.manual_seed(0)
    model = DecoderLM(tiny_config()).train()
    prepare_trainable(model, cfg.finetune)
    if checkpointing:
        apply_activation_checkpointing(model)
    opt = configure_optimizer(model, cfg)
    data = torch.randint(0, 65, (500,), generator=torch.Generator().manual_seed(0))
    par = Parallelized(model, model.device, model)
    for _ in range(2):
        batches = micro_batches(data, torch.Generator().manual_seed(1), cfg, DistInfo(), 32)
        train_step(par, opt, torch.amp.GradScaler("cpu", enabled=False), batches, cfg)
    ours = named_state_dicts(model, opt)
    theirs = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    _same_nested(ours[0], theirs[0], "model")
    _same_nested(ours[1], theirs[1], "optimizer")
    with pytest.raises(ValueError, match="no state yet"):
        named_state_dicts(model, configure_optimizer(model, cfg))


def test_a_checkpoint_with_flipped_weight_bytes_is_skipped_and_the_resume_stays_exact(
    corpus, tmp_path, capsys
):
    """A checkpoint whose model.safetensors or trainer_state.pt was changed in place (same
    size) no longer matches the sha256 its config.json records: resuming skips it, naming the
    file and both digests, and resumes from the one before, with the weights of an
    uninterrupted run."""
    whole, out = tmp_path / "whole", tmp_path / "run"
    assert main(train_argv(corpus, whole, "--max-steps", "6", "--decay-steps", "6")) == 0
    args = train_argv(
        corpus, out, "--max-steps", "4", "--decay-steps", "6", "--checkpoint-interval", "2"
    )
    assert main(args) == 0
    *_, older, newest = list_checkpoints(out)
    config = json.loads((newest / "config.json").read_text())
    assert set(config["checksums"]) == {"model.safetensors", "trainer_state.pt"}
    recorded = config["checksums"]["model.safetensors"]["sha256"]
    with open(newest / "model.safetensors", "r+b") as f:  # the last bytes: tensor data
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x00\x80\x7f")
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--max-steps", "6"]) == 0
    log = capsys.readouterr().out
    assert "skipping checkpoint" in log and recorded in log and "model.safetensors" in log
    assert (out / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    assert older.name == "step-00000002"
    state = list_checkpoints(out)[-1] / "trainer_state.pt"
    with open(state, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ValueError, match="trainer_state.pt has sha256 .* but config.json records"):
        load_trainer_state(state.parent)


def stop_after(monkeypatch, steps):
    """Make the next in-process run stop as Ctrl-C stops it, after optimizer step `steps`
    (the loop's ranks agree to stop then); undone by the returned function."""
    import decoderlm.training.loop as loop

    done = []

    def agree(loss, stop, info):
        done.append(1)
        return len(done) >= steps

    monkeypatch.setattr(loop, "agree_across_ranks", agree)
    return lambda: monkeypatch.setattr(loop, "agree_across_ranks", lambda loss, stop, info: stop)


def test_the_printed_resume_line_alone_repeats_the_runs_threads_and_resumes_exactly(
    corpus, uninterrupted, tmp_path, monkeypatch, capsys
):
    """A --threads 1 run stopped like Ctrl-C at step 10 records its device, threads and merge
    in config.json; the `resume with:` line it prints, run as it is where torch's default
    is 2 threads, trains at the run's 1 thread (saying so on stderr) and logs the losses of
    the uninterrupted 1-thread run bit for bit."""
    out = tmp_path / "run"
    undo = stop_after(monkeypatch, 10)
    args = train_argv(corpus, out, "--max-steps", "20", "--decay-steps", "20", "--threads", "1")
    assert main(args) == 0
    undo()
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("resume with: "))
    assert line == f"resume with: decoderlm train --resume {out}"
    checkpoint = list_checkpoints(out)[-1]
    assert checkpoint.name == "step-00000010" and not (out / "model.safetensors").exists()
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["run_options"] == {"device": "cpu", "threads": 1, "merge": False}
    torch.set_num_threads(2)  # the machine's default here, were it not for the record
    try:
        assert main(line.removeprefix("resume with: decoderlm ").split()) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)
    err = capsys.readouterr().err.splitlines()  # then the progress bar
    assert err[0] == (
        "resuming with the run's --device cpu --threads 1 --merge false (give a flag to change one)"
    )
    assert_same_run(uninterrupted, out)


def test_a_resume_that_changes_the_threads_says_so_and_one_that_cannot_repeat_them_is_refused(
    corpus, tmp_path, capsys
):
    out = tmp_path / "run"
    assert main(train_argv(corpus, out, "--max-steps", "2", "--threads", "1")) == 0
    capsys.readouterr()
    assert (
        main(["train", "--resume", str(out), "--max-steps", "3", "--threads", "1", "--no-progress"])
        == 0
    )
    assert capsys.readouterr().err.splitlines() == [
        "resuming with the run's --device cpu --merge false (give a flag to change one)"
    ]
    config = out / "checkpoints" / "step-00000003" / "config.json"
    record = json.loads(config.read_text())
    record["run_options"]["threads"] = (os.cpu_count() or 1) + 1
    config.write_text(json.dumps(record))
    one_line_error(capsys, ["train", "--resume", str(out), "--max-steps", "4"], "--threads N")
    assert (
        main(["train", "--resume", str(out), "--max-steps", "4", "--threads", "1", "--no-progress"])
        == 0
    )
    err = capsys.readouterr().err
    assert f"changes the run's threads {(os.cpu_count() or 1) + 1} to 1" in err
    assert "losses differ from an uninterrupted run's" in err


def test_resume_options_taken_given_and_refused():
    from decoderlm.errors import UserError
    from decoderlm.training.run_options import resumed_run_options

    stored = {"device": "cpu", "threads": 1, "merge": True}
    options, notes = resumed_run_options(stored, {"threads": None, "device": None, "merge": None})
    assert options == stored and notes == [
        "resuming with the run's --device cpu --threads 1 --merge (give a flag to change one)"
    ]
    options, notes = resumed_run_options(stored, {"threads": "auto", "merge": False})
    assert options == {"device": "cpu", "threads": "auto", "merge": False}
    assert notes[1].startswith("warning: this resume changes the run's threads 1 to auto")
    assert resumed_run_options({}, {"threads": 2}) == (
        {"threads": 2, "device": None, "merge": None},
        [],
    )
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="trained on cuda, which this machine does not have"):
            resumed_run_options({"device": "cuda"}, {})
        assert resumed_run_options({"device": "cuda"}, {"device": "cpu"})[0]["device"] == "cpu"


def test_a_checkpoint_set_aside_as_damaged_resumes_with_the_no_verify_its_hint_names(
    corpus, tmp_path, capsys
):
    """The only checkpoint, its weights changed in place (same size: the sha256 check
    fails), is set aside as damaged-step-2 by --resume, whose warning names `--resume DIR
    --no-verify`; a plain --resume then says the same in one line; and that command
    resumes from damaged-step-2, unchecked."""
    out = tmp_path / "run"
    assert main(train_argv(corpus, out, "--max-steps", "2")) == 0
    (only,) = list_checkpoints(out)
    with open(only / "model.safetensors", "r+b") as f:  # the last bytes: tensor data
        f.seek(-4, os.SEEK_END)
        byte = f.read(1)
        f.seek(-4, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))  # the lowest mantissa bit of one weight
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--max-steps", "4"]) == 2
    captured = capsys.readouterr()
    hint = f"`decoderlm train --resume {out} --no-verify` tries it unchecked"
    assert "skipping checkpoint" in captured.out and hint in captured.out
    assert "no checkpoint in" in captured.err
    assert not list_checkpoints(out) and (out / "checkpoints" / "damaged-step-00000002").is_dir()
    one_line_error(
        capsys,
        ["train", "--resume", str(out), "--max-steps", "4"],
        "damaged-step-00000002",
        f"`decoderlm train --resume {out} --no-verify`",
    )
    assert main(["train", "--resume", str(out), "--no-verify", "--max-steps", "4"]) == 0
    said = capsys.readouterr().out
    assert f"resuming from {out / 'checkpoints' / 'damaged-step-00000002'}" in said
    assert [p.name for p in list_checkpoints(out)] == ["step-00000004"]
    assert (out / "model.safetensors").is_file()
