"""The settings of `decoderlm train` that neither config.json's "model" nor its "train" holds
but that a resumed run must repeat to compute what an uninterrupted run computes and to end
as it would have: config.json["run_options"] of a run and of each of its checkpoints.

    device    the device trained on ("cpu", "cuda", "cuda:1", ...; the kind alone under
              several processes, each of which takes its own index)
    threads   torch's CPU threads: the --threads given (N or "auto"), or the count torch
              used when none was (float sums depend on it, so a resume at another count is
              not bit-exact)
    merge     whether the run writes merged/ at its end (--merge, LoRA runs)

`run_options` is the record of a new run; `resumed_run_options` is what `--resume DIR`
uses: the newest checkpoint's record (`stored_run_options`), a flag given on the resume line
taking precedence (with a warning when it changes the device or the threads).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..errors import UserError
from ..files import read_json
from ..model.weights import CONFIG_NAME, list_checkpoints

__all__ = ["RUN_OPTIONS", "resumed_run_options", "run_options", "stored_run_options"]

RUN_OPTIONS = ("device", "threads", "merge")


def run_options(device: torch.device, world_size: int, threads, merge: bool) -> dict:
    """The config.json["run_options"] of a run training on `device` in `world_size`
    processes, whose --threads was `threads` (None: torch's count now is recorded) and
    --merge `merge`."""
    return {
        "device": str(device) if world_size == 1 else device.type,
        "threads": torch.get_num_threads() if threads is None else threads,
        "merge": bool(merge),
    }


def stored_run_options(run_dir: str | Path, damaged: bool = False) -> dict:
    """The "run_options" of the newest checkpoint of `run_dir` whose config.json reads ({}
    where none does, or it records none: a run written before they were recorded).
    damaged: also read the checkpoints set aside as checkpoints/damaged-step-N."""
    candidates = list_checkpoints(run_dir)
    if damaged:
        candidates += sorted((Path(run_dir) / "checkpoints").glob("damaged-step-*"))
    for checkpoint in sorted(candidates, key=_step, reverse=True):
        try:
            config = read_json(checkpoint / CONFIG_NAME)
        except (UserError, OSError, ValueError):
            continue
        options = config.get("run_options") if isinstance(config, dict) else None
        return dict(options) if isinstance(options, dict) else {}
    return {}


def _step(checkpoint: Path) -> int:
    """The step of checkpoints/step-N or damaged-step-N (-1 for a malformed name)."""
    found = re.match(r"(?:damaged-)?step-(\d+)", checkpoint.name)
    return int(found[1]) if found else -1


def resumed_run_options(stored: dict, given: dict) -> tuple[dict, list[str]]:
    """The device, threads and merge a resumed run uses.

    Args:
        stored: the run's record (`stored_run_options`; {} for none).
        given: {"device", "threads", "merge"} of the resume's command line, None where not
            given.

    Returns:
        ({"device", "threads", "merge"}: each given value, else the run's, else None; the
        lines to print once the resume is known to start: which settings were taken from
        the run, and a warning when a given device or thread count differs from the run's).

    Raises:
        UserError: a setting taken from the run that this machine cannot repeat (a device it
            lacks, more threads than its CPUs), naming the flag that resumes anyway.
    """
    options = {name: given.get(name) for name in RUN_OPTIONS}
    taken = {}
    for name in RUN_OPTIONS:
        if options[name] is None and stored.get(name) is not None:
            options[name] = taken[name] = stored[name]
    if "device" in taken:
        _check_device(taken["device"])
    if isinstance(taken.get("threads"), int) and taken["threads"] > (os.cpu_count() or 1):
        raise UserError(
            f"the run trained with {taken['threads']} CPU threads and this machine has "
            f"{os.cpu_count()} CPUs; give --threads N to resume with fewer (its losses then "
            f"differ from an uninterrupted run's)"
        )
    notes = []
    if taken:
        flags = " ".join(_flag(name, value) for name, value in taken.items())
        notes.append(f"resuming with the run's {flags} (give a flag to change one)")
    changed = [
        f"{name} {stored[name]} to {given[name]}"
        for name in ("device", "threads")
        if given.get(name) is not None
        and stored.get(name) is not None
        and str(given[name]) != str(stored[name])
    ]
    if changed:
        notes.append(
            f"warning: this resume changes the run's {' and '.join(changed)}; its losses differ "
            f"from an uninterrupted run's (give the run's to resume it bit for bit)"
        )
    return options, notes


def _flag(name: str, value) -> str:
    """How a setting is written on the command line: --merge, --merge false, --threads 1."""
    if value is True:
        return f"--{name}"
    return f"--{name} {str(value).lower() if isinstance(value, bool) else value}"


def _check_device(device: str) -> None:
    """UserError when this machine lacks the device kind a run trained on."""
    kind = device.split(":")[0]
    available = {"cpu": True, "cuda": torch.cuda.is_available()}
    available["mps"] = torch.backends.mps.is_available()
    if not available.get(kind, False):
        raise UserError(
            f"the run trained on {device}, which this machine does not have; give --device "
            f"cpu to resume on the CPU (its losses then differ from an uninterrupted run's)"
        )
