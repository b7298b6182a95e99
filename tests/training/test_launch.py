"""`decoderlm train --nproc-per-node N` (training.launch): Ctrl-C stops every process after a
checkpoint, without torchrun's traceback, and the resume command is the one launched."""

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from decoderlm import DecoderLM
from decoderlm.config import TrainConfig
from decoderlm.model.weights import list_checkpoints
from decoderlm.training import launch
from decoderlm.training.loop import train
from decoderlm.training.parallel import init_distributed

from conftest import tiny_config

TEXT = "".join(chr(33 + (i * 7919) % 60) for i in range(3000))
TINY = ["--n-layers", "1", "--n-heads", "2", "--d-model", "16", "--block-size", "16"]


def test_resume_command_as_launched(monkeypatch, tmp_path):
    for name in (launch.LAUNCHED_AS, "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert launch.resume_command(tmp_path / "a b") == f"decoderlm train --resume '{tmp_path}/a b'"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")  # a worker of a bare torchrun
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(sys, "argv", ["/x/decoderlm/__main__.py", "train", "--lr", "1e-3"])
    parent = [sys.executable, "/venv/bin/torchrun", "--nproc_per_node", "4", "-m", "decoderlm"]
    monkeypatch.setattr(launch, "_parent_cmdline", lambda: [*parent, "train", "--lr", "1e-3"])
    assert launch.resume_command("r") == (
        "torchrun --nproc_per_node 4 -m decoderlm train --resume r"
    )
    monkeypatch.setattr(launch, "_parent_cmdline", lambda: None)  # no /proc
    assert launch.resume_command("r") == "torchrun --nproc-per-node 4 -m decoderlm train --resume r"
    monkeypatch.setenv(launch.LAUNCHED_AS, "decoderlm train --nproc-per-node=4")
    assert launch.resume_command("r") == "decoderlm train --nproc-per-node=4 --resume r"


def test_ctrl_c_stops_two_gloo_processes_cleanly(tmp_path):
    data, out = tmp_path / "text.txt", tmp_path / "run"
    data.write_text(TEXT, encoding="utf-8")
    argv = [sys.executable, "-m", "decoderlm", "train", "--data", str(data), "--out", str(out)]
    flags = ["--max-steps", "100000", "--checkpoint-interval", "5", "--eval-interval", "100000"]
    proc = subprocess.Popen(
        [*argv, *TINY, *flags, "--dtype", "fp32", "--no-progress", "--nproc-per-node", "2"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    deadline = time.monotonic() + 180
    while not list_checkpoints(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # Ctrl-C reaches the launcher's process group; the workers have sessions of their own
    # (torchrun's), and torchrun sends the signal on to each in turn, rank 0 first
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr
    assert "stopped by signal after step" in stdout and "checkpoint saved" in stdout
    assert f"resume with: decoderlm train --nproc-per-node=2 --resume {out}" in stdout
    assert not (out / "model.safetensors").exists()  # stopped, not finished
    assert list_checkpoints(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_interrupted_after_agreeing(rank, port, out_dir, data):
    """One of two gloo ranks training TINY; rank 0 gets SIGINT right after the ranks agreed
    on step 3's stop flag (in on_step), where a stop decided by the signal alone would leave
    rank 1 waiting in step 4's all-reduce. A 60 s gloo timeout ends that wait in an error."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(LOCAL_RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    info, _ = init_distributed("cpu")
    steps = []

    def on_step(seconds):
        steps.append(seconds)
        if rank == 0 and len(steps) == 3:
            os.kill(os.getpid(), signal.SIGINT)

    torch.manual_seed(0)
    cfg = TrainConfig.from_dict(dict(batch_size=2, max_steps=1000, eval_interval=1000, seed=3))
    result = train(
        DecoderLM(tiny_config()), cfg, data[:1800], data[1800:], out_dir, False, info,
        on_step=on_step,
    )  # fmt: skip
    (out_dir / f"rank{rank}.json").write_text(json.dumps([result.step, result.interrupted]))
    dist.destroy_process_group()


def test_a_signal_after_the_stop_agreement_stops_both_ranks_after_the_same_step(tmp_path):
    data = torch.randint(0, 65, (2000,), generator=torch.Generator().manual_seed(0))
    mp.spawn(_rank_interrupted_after_agreeing, args=(_free_port(), tmp_path, data), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks == [[4, True], [4, True]]  # rank 0's signal counted at step 4's agreement
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step-00000004"]
