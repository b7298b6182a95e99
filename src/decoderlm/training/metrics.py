"""The derived metrics of a training record and where records go besides metrics.jsonl.

`RecordExtras` adds to each record of `loop.MetricsLog`:
    grad_norm  the global L2 norm of the gradients of the step (what
               torch.nn.utils.clip_grad_norm_ returns, before clipping; computed also when
               clipping is off)
    mfu        model FLOP utilisation: tokens_per_s * training FLOPs per token (the Kaplan
               et al. 2020 count of `decoderlm.model.analysis.flops_per_token`) / (peak FLOP/s *
               processes). The peak is --peak-tflops, else a small table of known GPUs'
               dense bfloat16 / float16 / float32 peaks, else on the CPU a matmul peak
               measured once per process (`measured_matmul_peak`, the higher of the dtype's
               and float32's); omitted when unknown.
    val_bpb    bits per UTF-8 byte of the validation text: val_bpc * (validation tokens /
               validation bytes), comparable across char, byte and BPE tokenizers (val_bpc
               is bits per token).

`Sinks` writes the same records to metrics.csv (--log csv) and to TensorBoard event files
in tensorboard/ (--log tensorboard; needs the optional `tensorboard` package) under the tags
of `TAGS`.
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import time
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig, TrainConfig
from ..data.conversations import Conversations
from ..errors import UserError
from ..evaluate import LN2
from ..files import atomic_write
from ..model.analysis import flops_per_token, mfu

__all__ = [
    "RecordExtras",
    "Sinks",
    "TAGS",
    "CSV_COLUMNS",
    "peak_flops",
    "measured_matmul_peak",
    "check_sinks",
]

# dense (no sparsity) tensor-core peaks in FLOP/s, from the vendors' data sheets (SXM parts)
_GPU_PEAKS = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "L40S": {"bfloat16": 362e12, "float16": 362e12, "float32": 91.6e12},
    "L4": {"bfloat16": 121e12, "float16": 121e12, "float32": 30.3e12},
    "V100": {"float16": 125e12, "float32": 15.7e12},
}

# metrics.jsonl keys -> TensorBoard tags
TAGS = {
    "train_loss": "train/loss",
    "val_loss": "val/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "mfu": "train/mfu",
    "tokens_per_s": "train/tokens_per_s",
    "val_bpb": "val/bpb",
}

CSV_COLUMNS = (
    "step",
    "train_loss",
    "lr",
    "grad_norm",
    "tokens",
    "elapsed_s",
    "tokens_per_s",
    "mfu",
    "val_loss",
    "val_bpc",
    "val_bpb",
)


@functools.cache
def measured_matmul_peak(dtype: str = "float32", n: int = 512, seconds: float = 0.05) -> float:
    """FLOP/s of the fastest of repeated [n, n] @ [n, n] products in `dtype` on the CPU with
    torch's current threads (2 n^3 FLOPs each), over about `seconds`; measured once per
    process and settings."""
    g = torch.Generator().manual_seed(0)  # its own: training's RNG streams stay untouched
    a, b = (torch.randn(n, n, generator=g).to(getattr(torch, dtype)) for _ in range(2))
    torch.mm(a, b)  # warm-up
    best, deadline = float("inf"), time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
        if start > deadline:
            return 2 * n**3 / best


def peak_flops(device: torch.device, dtype: str, given_tflops: float | None = None):
    """Peak FLOP/s of one process's device for `dtype`: given_tflops * 1e12 when given, a
    known GPU's data-sheet peak, the measured CPU matmul peak, or None (an unknown GPU)."""
    if given_tflops is not None:
        return given_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in _GPU_PEAKS.items():
            if key in name:
                return peaks.get(dtype)
        return None
    if device.type == "cpu":  # a slow dtype (float16 here) runs some products in float32
        return max(measured_matmul_peak(dtype), measured_matmul_peak("float32"))
    return None


def bytes_per_token(tokenizer, ids) -> float | None:
    """UTF-8 bytes of the decoded ids per token, or None without a tokenizer or ids, or for
    `Conversations` (their loss covers the replies only, not every token)."""
    if tokenizer is None or len(ids) == 0 or isinstance(ids, Conversations):
        return None
    n_bytes = sum(
        len(tokenizer.decode(np.asarray(ids[i : i + 65536]).tolist()).encode("utf-8"))
        for i in range(0, len(ids), 65536)
    )
    return n_bytes / len(ids) if n_bytes else None


class RecordExtras:
    """Adds grad_norm, mfu and val_bpb to a record (see the module docstring).

    Args:
        config: the model's ModelConfig (for the FLOPs per token).
        cfg: the TrainConfig (compute.dtype, logging.peak_tflops).
        device: this process's device.
        world_size: processes training together.
        val_bytes_per_token: UTF-8 bytes per validation token (`bytes_per_token`); None
            leaves val_bpb out.
    """

    def __init__(
        self,
        config: ModelConfig,
        cfg: TrainConfig,
        device: torch.device,
        world_size: int = 1,
        val_bytes_per_token: float | None = None,
    ):
        self.flops = flops_per_token(config)["training"]
        peak = peak_flops(device, cfg.compute.dtype, cfg.logging.peak_tflops)
        self.peak = None if peak is None else peak * world_size
        self.val_bytes_per_token = val_bytes_per_token

    def add(self, record: dict, grad_norm: float | None = None) -> dict:
        """record with grad_norm (when given), mfu (when the peak is known) and val_bpb (on
        evaluation records, when the bytes per token are known) added; returns it."""
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        if self.peak is not None and "tokens_per_s" in record:
            record["mfu"] = mfu(self.flops, record["tokens_per_s"], self.peak)
        if self.val_bytes_per_token and "val_loss" in record:
            record["val_bpb"] = record["val_loss"] / LN2 / self.val_bytes_per_token
        return record


def check_sinks(cfg: TrainConfig) -> None:
    """Raise UserError when a sink of cfg.logging.log needs a package that is not installed."""
    if "tensorboard" in cfg.logging.log and importlib.util.find_spec("tensorboard") is None:
        raise UserError(
            "--log tensorboard needs the tensorboard package: pip install "
            "'decoderlm[tensorboard]' (or drop --log tensorboard)"
        )


class Sinks:
    """metrics.csv and TensorBoard event files of a run directory, as cfg.logging.log asks.

    A resumed run (first_step > 0) keeps the CSV rows up to first_step and tells TensorBoard
    to drop the events after it (purge_step), so neither repeats the steps done again.
    """

    def __init__(self, run_dir: Path, cfg: TrainConfig, first_step: int = 0):
        check_sinks(cfg)
        self.csv_file = self.writer = None
        if "csv" in cfg.logging.log:
            self.csv_file = _open_csv(run_dir / "metrics.csv", first_step)
            self.csv = csv.DictWriter(self.csv_file, CSV_COLUMNS, extrasaction="ignore")
            if self.csv_file.tell() == 0:
                self.csv.writeheader()
        if "tensorboard" in cfg.logging.log:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(
                str(run_dir / "tensorboard"), purge_step=first_step + 1 if first_step else None
            )

    def write(self, record: dict) -> None:
        """Append one record (a metrics.jsonl object) to every sink."""
        if self.csv_file is not None:
            self.csv.writerow(record)
            self.csv_file.flush()
        if self.writer is not None:
            for key, tag in TAGS.items():
                if key in record:
                    self.writer.add_scalar(tag, record[key], record["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.csv_file is not None:
            self.csv_file.close()
        if self.writer is not None:
            self.writer.close()


def _open_csv(path: Path, first_step: int):
    """path opened for appending, without the rows after first_step (a resumed run)."""
    if path.exists():
        with open(path, newline="", encoding="utf-8") as f:
            rows = [r for r in csv.DictReader(f) if first_step and int(r["step"]) <= first_step]

        def write(tmp):
            with open(tmp, "w", newline="", encoding="utf-8") as f:
                writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(rows)

        atomic_write(path, write)
    return open(path, "a", newline="", encoding="utf-8")
