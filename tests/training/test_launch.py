"""`decoderlm train --nproc-per-node N` (training.launch): Ctrl-C stops every process after a
checkpoint, without torchrun's traceback, and the resume command is the one launched."""

import os
import signal
import subprocess
import sys
import time

from decoderlm.model.weights import list_checkpoints
from decoderlm.training import launch

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
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the launcher and both workers get it
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr
    assert "stopped by signal after step" in stdout and "checkpoint saved" in stdout
    assert f"resume with: decoderlm train --nproc-per-node=2 --resume {out}" in stdout
    assert not (out / "model.safetensors").exists()  # stopped, not finished
    assert list_checkpoints(out)
