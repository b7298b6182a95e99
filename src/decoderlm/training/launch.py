"""Starting the processes of a distributed run (`decoderlm train --nproc-per-node N`), and the
command that resumes a run as it was launched.

`launch` runs torch.distributed.run (torchrun --standalone) inside this process with
`-m decoderlm` and the same command line as its workers' entry point. On Ctrl-C (SIGINT) or
SIGTERM torchrun's agent sends the signal on to the workers (each in a session of its own, so
a terminal's Ctrl-C reaches only this process), one after the other. The workers finish their
step and stop after the first step at which any of them had the signal, all after the same
one (`parallel.agree_across_ranks`), save a checkpoint and print how to resume, as one
process does; `launch` then returns 0 without torchrun's traceback. A worker still running
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default here 600: time to save a checkpoint) after the
signal is killed. A worker's one-line error (exit status 2) ends the launch with status 2.

`resume_command(run_dir)` is the command line that resumes a run the way this process was
started: `decoderlm train --nproc-per-node N --resume DIR` under `launch`; under a bare
torchrun the torchrun command read from the launcher's /proc/PID/cmdline (Linux), else
`torchrun --nproc-per-node N -m decoderlm train --resume DIR`; else `decoderlm train --resume
DIR`.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path

__all__ = ["LAUNCHED_AS", "launch", "resume_command"]

LAUNCHED_AS = "DECODERLM_LAUNCHED_AS"  # environment: the command prefix `launch` started


def launch(argv: list[str], nproc_per_node: int) -> int:
    """Run `decoderlm *argv` in `nproc_per_node` processes through torchrun --standalone
    (gloo on the CPU, NCCL on GPUs; see training.parallel); returns the exit status.

    argv: the `decoderlm` arguments, `train` first, as given (its --nproc-per-node is ignored
    by the workers, which see LOCAL_RANK).
    """
    os.environ.setdefault("LOGLEVEL", "ERROR")  # torchrun's own notices (read at import)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")  # time to save a checkpoint
    os.environ[LAUNCHED_AS] = shlex.join(
        ["decoderlm", "train", f"--nproc-per-node={nproc_per_node}"]
    )
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for name in list(logging.root.manager.loggerDict):  # each has its own level
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.ERROR)

    args = ["--standalone", f"--nproc-per-node={nproc_per_node}", "-m", "decoderlm", *argv]
    try:
        torchrun.run(torchrun.parse_args(args))
    except SignalException:  # the workers were told too; rank 0 printed how to resume
        return 0
    except KeyboardInterrupt:  # before the workers started
        print("decoderlm: interrupted", file=sys.stderr)
        return 130
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        if codes == [2]:  # a user error, printed in one line by rank 0
            return 2
        print(
            f"decoderlm: error: {len(e.failures)} of {nproc_per_node} training processes "
            f"failed (exit status {', '.join(map(str, codes))}); see their messages above",
            file=sys.stderr,
        )
        return 1
    return 0


def _parent_cmdline() -> list[str] | None:
    """The command line of this process's parent (Linux /proc), None where unreadable."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode("utf-8", errors="replace").split("\0")[:-1]


def _torchrun_prefix() -> str | None:
    """The torchrun command (without `train` and its flags) that started this worker, from
    the parent's command line; None where it cannot be read."""
    parent, tail = _parent_cmdline() or [], sys.argv[1:]
    if not tail or len(parent) <= len(tail) or parent[-len(tail) :] != tail:
        return None
    head = parent[: -len(tail)]
    if Path(head[0]).name.startswith("python") and len(head) > 1 and head[1].endswith("torchrun"):
        head = ["torchrun", *head[2:]]
    return shlex.join(head)


def resume_command(run_dir: str | Path) -> str:
    """The command line that resumes the run in `run_dir` as this process was launched (see
    the module docstring)."""
    resume = f"--resume {shlex.quote(str(run_dir))}"
    if os.environ.get(LAUNCHED_AS):
        return f"{os.environ[LAUNCHED_AS]} {resume}"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        prefix = _torchrun_prefix() or (
            f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', '1')} -m decoderlm"
        )
        return f"{prefix} train {resume}"
    return f"decoderlm train {resume}"
