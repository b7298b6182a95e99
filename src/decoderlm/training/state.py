"""The resumable state of a training run, as one object (`TrainState`).

`TrainState.state_dict()` is what a checkpoint stores: the model's weights (written to
model.safetensors) and the trainer state (written to trainer_state.pt, see
`decoderlm.training.checkpoints`): step, tokens, elapsed_s, loss_sum / loss_n (the train
losses since the last metrics record), optimizer, data_sampler (the window generator's
state), rng (the RNG states of every rank), scaler (the float16 loss scaler, {} otherwise),
world_size and train (the TrainConfig). Only tensors and plain Python values, so the file
loads with torch.load(weights_only=True). `load_state_dict` restores all of it; a resumed
run then computes exactly what an uninterrupted one would have.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import torch

from ..config import TrainConfig
from ..errors import UserError
from ..model.model import DecoderLM
from ..model.weights import list_checkpoints
from .checkpoints import save_checkpoint
from .parallel import DistInfo, barrier, gather_across_ranks

__all__ = ["TrainState", "rng_state", "set_rng_state", "named_state_dicts"]

# path segments that wrappers put into parameter names but not into state dict keys
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod")


def rng_state() -> dict:
    """Every RNG this process draws from: Python, NumPy, torch CPU and CUDA."""
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            **np_state,
            "state": {
                "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                "pos": np_state["state"]["pos"],
            },
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def named_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """(model state dict, optimizer state dict) of one process, on the CPU, in the format of
    torch.distributed.checkpoint's `get_state_dict(full_state_dict=True, cpu_offload=True)`:
    the optimizer's per-parameter state and param_groups' "params" keyed by parameter name
    (the state dict key) instead of index. Written out so that a one-process run does not
    import torch.distributed.checkpoint (and with it DTensor and FSDP, slow to import).

    Raises:
        UserError: the optimizer has no state yet (get_state_dict would initialise it with a
            zero step; `TrainState.state_dict` leaves that case to get_state_dict).
    """
    if not optimizer.state:
        raise UserError("the optimizer has no state yet")
    order = [p for group in optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(order)}
    names = {}
    for name, param in model.named_parameters():
        if id(param) in index:
            names[index[id(param)]] = ".".join(
                part for part in name.split(".") if part not in _WRAPPER_SEGMENTS
            )
    saved = optimizer.state_dict()
    optim_state = {
        "state": {names[i]: _to_cpu(s) for i, s in saved["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]
        ],
    }
    return _to_cpu(model.state_dict()), optim_state


def _to_cpu(value):
    """value with every tensor inside its dicts and lists on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def set_rng_state(state: dict) -> None:
    """Restore the RNG states saved by `rng_state`."""
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(
        {
            **np_state,
            "state": {
                "key": np_state["state"]["key"].numpy().astype(np.uint32),
                "pos": np_state["state"]["pos"],
            },
        }
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class TrainState:
    """Everything a training run needs to continue exactly where it stopped.

    Attributes:
        model, optimizer, scaler: what is trained and how (the GradScaler is disabled unless
            float16).
        generator: the torch.Generator that draws the training windows.
        step: optimizer steps done. loss_sum, loss_n: the sum and count of the train losses
            not yet logged in a metrics record.
        tokens_per_step: training tokens per optimizer step, all ranks together (window
            tokens: block_size per sequence, or `window` when given).
    """

    def __init__(
        self,
        model: DecoderLM,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        generator: torch.Generator,
        cfg: TrainConfig,
        info: DistInfo,
        log=print,
        window: int | None = None,
    ):
        self.model, self.optimizer = model, optimizer
        self.scaler, self.generator = scaler, generator
        self.cfg, self.info, self.log = cfg, info, log
        sequences = cfg.data.batch_size * cfg.data.grad_accum_steps * info.world_size
        self.tokens_per_step = sequences * (window or model.config.block_size)
        self.step, self.loss_sum, self.loss_n = 0, 0.0, 0
        self._elapsed_before, self._start = 0.0, time.perf_counter()

    @property
    def tokens(self) -> int:
        """Training tokens seen so far, all ranks together."""
        return self.step * self.tokens_per_step

    def start_clock(self) -> None:
        """Count elapsed time from now on (on top of the time before a resume)."""
        self._start = time.perf_counter()

    def run_seconds(self) -> float:
        """Seconds since `start_clock` (this run alone)."""
        return time.perf_counter() - self._start

    def elapsed(self) -> float:
        """Seconds of training, over every run that led to this state."""
        return self._elapsed_before + time.perf_counter() - self._start

    def add_loss(self, loss: float) -> None:
        """Count one more optimizer step, whose train loss was `loss`."""
        self.loss_sum, self.loss_n = self.loss_sum + loss, self.loss_n + 1
        self.step += 1

    def take_mean_loss(self) -> float:
        """The mean train loss since the last call (or the start), and start a new mean."""
        mean = self.loss_sum / self.loss_n
        self.loss_sum, self.loss_n = 0.0, 0
        return mean

    def state_dict(self) -> dict:
        """The whole state: the trainer state (see the module docstring) and, under "model",
        the model's full state dict on the CPU. Every rank must call it (it gathers FSDP's
        shards and every rank's RNG state)."""
        if self.info.world_size == 1 and self.optimizer.state:
            model_state, optim_state = named_state_dicts(self.model, self.optimizer)
        else:  # DDP / FSDP2 (gathers the shards), or an optimizer without state yet
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            model_state, optim_state = get_state_dict(
                self.model,
                self.optimizer,
                options=StateDictOptions(full_state_dict=True, cpu_offload=True),
            )
        return {
            "step": self.step,
            "tokens": self.tokens,
            "elapsed_s": self.elapsed(),
            "loss_sum": self.loss_sum,
            "loss_n": self.loss_n,
            "optimizer": optim_state,
            "data_sampler": self.generator.get_state(),
            "rng": gather_across_ranks(rng_state(), self.info),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "world_size": self.info.world_size,
            "train": self.cfg.to_dict(),
            "model": model_state,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state written by `state_dict` (or a checkpoint's trainer_state.pt, whose
        model weights are then already in the model). A checkpoint written by another number
        of processes resumes too, with a warning: this rank takes the RNG state of rank
        (rank mod their count), so dropout draws differ from an uninterrupted run."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True)
        if "model" in state:
            set_model_state_dict(self.model, state["model"], options=full)
        self.step, self._elapsed_before = state["step"], state["elapsed_s"]
        self.loss_sum, self.loss_n = state["loss_sum"], state["loss_n"]
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=full)
        self.generator.set_state(state["data_sampler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        rngs = state["rng"]
        if len(rngs) != self.info.world_size:
            self.log(
                f"warning: the checkpoint was written by {len(rngs)} process(es) and this "
                f"run has {self.info.world_size}; dropout draws differ from an "
                f"uninterrupted run"
            )
        set_rng_state(rngs[self.info.rank % len(rngs)])

    def save(self, run_dir: Path, files: dict | None = None) -> Path | None:
        """Write a checkpoint of this state into run_dir/checkpoints/ (rank 0 writes; every
        rank must call this). files: {"extra": more config.json entries, "tokenizer": a
        tokenizer} stored with it.

        Returns:
            The checkpoint directory on rank 0, None on the other ranks.

        Raises:
            OSError: the checkpoint could not be written (the message names the last good
                one; earlier checkpoints are left untouched).
        """
        state, path = self.state_dict(), None
        if self.info.is_main:
            files = files or {}
            model_state = state.pop("model")
            try:
                path = save_checkpoint(
                    run_dir,
                    self.step,
                    {
                        "model": (model_state, self.model.config, files.get("extra")),
                        "tokenizer": files.get("tokenizer"),
                        "trainer_state": state,
                    },
                    self.cfg.checkpointing.keep_checkpoints,
                )
            except OSError as e:
                last_good = list_checkpoints(run_dir)[-1:]
                raise OSError(
                    f"saving the checkpoint of step {self.step} failed: {e}"
                    + (f"; the last good checkpoint is {last_good[0]}" if last_good else "")
                ) from None
        barrier(self.info)
        return path
