"""The training loop: `train` calls `train_step` once per optimizer step, and around it the
evaluation, the metrics log, checkpoints and stop requests.

Each optimizer step draws grad_accum_steps micro-batches; every micro-step draws
batch_size * world_size window starts from one generator seeded identically on every rank,
and rank r trains on the r-th slice. So N processes with batch_size b see exactly the windows
of one process with batch_size N * b, and the union of their (averaged) gradients is that
process's gradient.

metrics.jsonl gets one JSON object per logged step: step (optimizer steps done), train_loss
(mean over the steps since the last record and over all ranks, nats), lr, tokens (seen so
far, all ranks), elapsed_s, tokens_per_s, grad_norm (of the logged step, before clipping), mfu
(when the device's peak is known), and on evaluation steps val_loss (nats), val_bpc (val_loss
/ ln 2, bits per token), val_bpb (bits per UTF-8 byte of the validation text; see
`decoderlm.training.metrics`, which also writes the records to metrics.csv and TensorBoard,
cfg.logging.log), induction_score (per layer, the best head's) and probe_second_half_loss
(nats) on a repeated random-token probe (`decoderlm.lens.lens.probe_metrics`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config import TrainConfig
from ..cpu import native_bfloat16
from ..data.corpus import check_split, scored_windows, window_count, window_length, windows
from ..errors import UserError
from ..evaluate import LN2, evaluate
from ..lens.lens import default_probe, probe_metrics
from ..model.model import DecoderLM
from ..model.weights import list_checkpoints
from .metrics import RecordExtras, Sinks
from .optim import configure_optimizer, lr_at, set_lr
from .parallel import DistInfo, Parallelized, agree_across_ranks, gradient_sync, parallelize
from .state import TrainState

__all__ = ["train", "train_step", "TrainResult", "autocast_for", "resolve_dtype", "stop_requests"]


@dataclass
class TrainResult:
    """What `train` returns: the validation loss over the whole validation split at the end
    (None when the run was interrupted), the records logged by this call, and throughput."""

    val_loss: float | None
    metrics: list[dict]
    elapsed_s: float
    tokens_per_s: float
    step: int
    interrupted: bool = False
    checkpoint: Path | None = None


def resolve_dtype(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """cfg with compute.dtype "auto" replaced by the format training runs in on `device`:
    "bfloat16" on a GPU that supports it and on a CPU that multiplies it natively
    (`decoderlm.cpu.native_bfloat16`: AVX-512 BF16 or AMX), "float16" on older GPUs, "float32"
    on other CPUs (AVX2, where a bfloat16 training step of the default preset takes about
    4x a float32 one). Any other dtype: cfg itself."""
    if cfg.compute.dtype != "auto":
        return cfg
    if device.type == "cuda":
        dtype = "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
    else:
        dtype = "bfloat16" if device.type != "cpu" or native_bfloat16() else "float32"
    return TrainConfig.from_dict({**cfg.to_dict(), "dtype": dtype})


def autocast_for(cfg: TrainConfig, device: torch.device):
    """A factory of the mixed-precision context of cfg.compute.dtype (bfloat16 / float16 autocast;
    nothing for float32)."""
    dtype = cfg.compute.dtype
    if dtype in ("bfloat16", "float16"):
        return lambda: torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))
    return contextlib.nullcontext


@contextlib.contextmanager
def stop_requests():
    """While active, SIGINT and SIGTERM only append to the yielded list (read by the training
    loop, which then saves a checkpoint and stops). Outside the main thread signals cannot be
    caught."""
    requested: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    previous = {
        sig: signal.signal(sig, lambda signum, frame: requested.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield requested
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def micro_batches(
    train_ids, generator: torch.Generator, cfg: TrainConfig, info: DistInfo, block_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (x, y) [batch_size, block_size] windows of each micro-step of one optimizer
    step (see the module docstring)."""
    batch_size = cfg.data.batch_size
    for _ in range(cfg.data.grad_accum_steps):
        starts = torch.randint(
            window_count(train_ids, block_size),
            (batch_size * info.world_size,),
            generator=generator,
        )
        mine = starts[info.rank * batch_size : (info.rank + 1) * batch_size]
        yield windows(train_ids, mine, block_size)


def eval_window_count(cfg: TrainConfig, info: DistInfo) -> int:
    """Windows of each validation estimate during training: eval_batches batches of one
    optimizer step (batch_size * grad_accum_steps * world_size sequences), so how a step is
    split into micro-batches and processes does not change which windows are scored."""
    data = cfg.data
    return cfg.evaluation.eval_batches * data.batch_size * data.grad_accum_steps * info.world_size


def train_step(
    par: Parallelized,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    batches,
    cfg: TrainConfig,
    autocast=contextlib.nullcontext,
    grad_norms: list | None = None,
) -> torch.Tensor:
    """One optimizer step: forward and backward over the micro-batches (gradients synchronised
    across ranks on the last one only), gradient-norm clipping, the (scaled) optimizer step.

    grad_norms: a list to append the global L2 norm of the (unscaled) gradients to, before
    clipping (a scalar tensor; computed also without clipping, then the gradients are left
    exactly as they are).

    Returns:
        This rank's mean loss over the micro-batches, a detached scalar tensor.
    """
    accum, clip = cfg.data.grad_accum_steps, cfg.optim.grad_clip
    step_loss = torch.zeros((), device=par.device)
    for micro, (x, y) in enumerate(batches):
        with gradient_sync(par, last=micro == accum - 1):
            with autocast():
                _, loss = par.step_module(x.to(par.device), y.to(par.device))
            scaler.scale(loss / accum).backward()
        step_loss += loss.detach()
    norm = None
    if clip is not None:
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(par.model.parameters(), clip)
    elif grad_norms is not None:
        scaler.unscale_(optimizer)  # what scaler.step would do first
        grads = [p.grad for p in par.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
    if grad_norms is not None:
        grad_norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    step_loss /= accum
    return step_loss


class MetricsLog:
    """The records of logged steps: kept in `records`, appended to metrics.jsonl (rank 0 with
    a run directory), and with `progress` shown on a tqdm progress bar with a printed line per
    evaluation (rank 0); without it nothing is printed."""

    def __init__(
        self,
        run_dir: Path | None,
        cfg: TrainConfig,
        info: DistInfo,
        progress: bool,
        first_step: int,
        extras: RecordExtras | None = None,
    ):
        self.cfg, self.info, self.records, self.sink = cfg, info, [], None
        self.extras, self.sinks = extras, None
        self.probe = None  # () -> dict of more evaluation metrics (the lens probe)
        self.show = progress and info.is_main
        if info.is_main and run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.sink = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
            self.sinks = Sinks(run_dir, cfg, first_step)
        self.bar = tqdm(
            total=cfg.steps.max_steps,
            initial=first_step,
            disable=not self.show,
            unit="step",
            mininterval=0.5,
            dynamic_ncols=True,
        )

    def log_step(
        self, state: TrainState, lr: float, loss: float, evaluate_val, grad_norm=None
    ) -> None:
        """After an optimizer step: advance the bar and, on logging steps, write a record
        (with evaluate_val()'s validation loss on evaluation steps, and the step's grad_norm
        tensor, mfu and val_bpb, see `RecordExtras`)."""
        done, tokens, cfg = state.step, state.tokens, self.cfg
        self.bar.update(1)
        self.bar.set_postfix(
            loss=f"{loss:.3f}", tok_s=f"{tokens / max(state.elapsed(), 1e-9):,.0f}", refresh=False
        )
        is_eval = done % cfg.evaluation.eval_interval == 0 or done == cfg.steps.max_steps
        if not (done % cfg.logging.log_interval == 0 or is_eval):
            return
        record = {
            "step": done,
            "train_loss": state.take_mean_loss(),
            "lr": lr,
            "tokens": tokens,
            "elapsed_s": round(state.elapsed(), 3),
            "tokens_per_s": round(tokens / state.elapsed(), 1),
        }
        if is_eval:
            val = evaluate_val()
            record.update(val_loss=val, val_bpc=val / LN2, **(self.probe() if self.probe else {}))
            if self.show:
                self.bar.write(
                    f"step {done:>6}: train {record['train_loss']:.4f}, "
                    f"val {val:.4f} nats ({val / LN2:.3f} bits/token)"
                )
        if self.extras is not None:
            self.extras.add(record, None if grad_norm is None else grad_norm.item())
        self.records.append(record)
        if self.sink:
            self.sink.write(json.dumps(record) + "\n")
            self.sink.flush()
            self.sinks.write(record)

    def close(self) -> None:
        self.bar.close()
        if self.sink:
            self.sink.close()
            self.sinks.close()


def _initial_state(
    model: DecoderLM,
    cfg: TrainConfig,
    info: DistInfo,
    log,
    resume: dict | None,
    run_dir: Path | None,
    window: int,
) -> TrainState:
    """A new TrainState (the optimizer of `optim.configure_optimizer`, a loss scaler for
    float16, the window generator seeded with cfg.data.seed; `window` tokens per sequence),
    or the checkpoint's when resuming."""
    state = TrainState(
        model,
        configure_optimizer(model, cfg),
        torch.amp.GradScaler(model.device.type, enabled=cfg.compute.dtype == "float16"),
        torch.Generator().manual_seed(cfg.data.seed),
        cfg,
        info,
        log,
        window,
    )
    if resume is not None:
        state.load_state_dict(resume)
        _check_can_continue(state.step, cfg, run_dir)
    return state


def _check_can_continue(step: int, cfg: TrainConfig, run_dir: Path | None) -> None:
    """A resumed run must have steps left (or a final model still to write)."""
    max_steps = cfg.steps.max_steps
    if step > max_steps or (
        step == max_steps and run_dir is not None and (run_dir / "model.safetensors").exists()
    ):
        raise UserError(
            f"the checkpoint is at step {step} and max_steps is {max_steps}; "
            f"pass a larger --max-steps to train further"
        )


def _check_finite(loss: float, step: int, lr: float, run_dir: Path | None) -> float:
    """loss, unless it is NaN or inf: then UserError naming the last good checkpoint."""
    if not math.isfinite(loss):
        last_good = list_checkpoints(run_dir)[-1:] if run_dir else []
        raise UserError(
            f"the training loss became {loss} at step {step + 1} (lr {lr:.3g}); "
            f"try a lower learning rate, weight decay or float32"
            + (f"; the last good checkpoint is {last_good[0]}" if last_good else "")
        )
    return loss


def _checkpoint_due(step: int, cfg: TrainConfig, run_dir: Path | None) -> bool:
    """A periodic checkpoint after `step` (the last step's is written after the loop)."""
    interval = cfg.checkpointing.checkpoint_interval
    return (
        run_dir is not None
        and bool(interval)
        and step % interval == 0
        and step < cfg.steps.max_steps
    )


def _whole_split_loss(records: list[dict], step: int, eval_windows: int, n_windows: int):
    """The last record's val_loss when it was logged after `step` and its estimate covered
    every validation window (eval_windows at least the split's n_windows, `scored_windows`:
    the very computation of the final whole-split evaluation), else None."""
    last = records[-1] if records else {}
    if last.get("step") == step and "val_loss" in last and eval_windows >= n_windows:
        return last["val_loss"]
    return None


def train(
    model: DecoderLM,
    cfg: TrainConfig,
    train_ids,
    val_ids,
    run_dir: str | Path | None = None,
    progress: bool = True,
    info: DistInfo | None = None,
    resume: dict | None = None,
    checkpoint_files: dict | None = None,
    log=print,
    val_bytes_per_token: float | None = None,
    on_step: Callable[[float], None] | None = None,
) -> TrainResult:
    """Train `model` in place: cfg.optim.optimizer ("muon": Muon on the blocks' weight
    matrices and AdamW on the rest; "adamw": AdamW on everything; `optim.configure_optimizer`),
    the learning rate following cfg.steps.schedule ("wsd" warm-up-stable-decay, "cosine"
    warm-up + cosine decay, or "constant"; `optim.lr_at`), gradient-norm clipping, mixed
    precision, gradient accumulation, checkpoints, and DDP / FSDP2 under torchrun (see the
    module docstring for the batches and metrics.jsonl).

    Args:
        model: the DecoderLM, already on this process's device.
        cfg: the TrainConfig.
        train_ids, val_ids: [N] token ids (int64 tensors, or numpy / memmapped arrays).
        run_dir: where metrics.jsonl and checkpoints/ go (rank 0 writes); None keeps nothing.
        progress: show a tqdm progress bar on stderr and a line per evaluation (rank 0);
            False prints neither (metrics.jsonl and the returned records still have them).
        info: this process's DistInfo (see `parallel.init_distributed`); None: one process.
        resume: a checkpoint's trainer state to continue from (`load_trainer_state`; the
            model weights must already be the checkpoint's); see `TrainState`.
        checkpoint_files: stored in each checkpoint besides the trainer state:
            {"extra": config.json entries, "tokenizer": a tokenizer}.
        log: print function for messages (rank 0).
        val_bytes_per_token: UTF-8 bytes per validation token, for val_bpb (None: left out).
        on_step: called after each optimizer step with its wall time in seconds (e.g.
            `ThreadTuner.step_done`).

    SIGINT / SIGTERM: the current step finishes (the next one too when the signal comes after
    the step's stop agreement, `parallel.agree_across_ranks`), a checkpoint is saved,
    interrupted=True.

    Returns:
        TrainResult; val_loss covers the whole validation split (None if interrupted).

    Raises:
        UserError: a split is shorter than block_size + 1 tokens, or the loss becomes NaN or
            inf (the last good checkpoint is left in place).
    """
    T, info = model.config.block_size, info or DistInfo()
    check_split("train", train_ids, T)
    check_split("validation", val_ids, T)
    device, run_dir = model.device, Path(run_dir) if run_dir is not None else None
    log, cfg = info.main_only(log), resolve_dtype(cfg, device)
    par = parallelize(model, cfg, info, device)
    window = window_length(train_ids, T)
    state = _initial_state(model, cfg, info, log, resume, run_dir, window)
    autocast, first_step = autocast_for(cfg, device), state.step
    eval_windows = eval_window_count(cfg, info)
    batch_size = cfg.data.batch_size
    validate = functools.partial(evaluate, model, val_ids, eval_windows, batch_size, autocast)
    extras = RecordExtras(model.config, cfg, device, info.world_size, val_bytes_per_token)
    metrics = MetricsLog(run_dir, cfg, info, progress, first_step, extras)
    norms: list = []
    probe = default_probe(model.config.vocab_size, T)
    metrics.probe = functools.partial(probe_metrics, model, probe)
    checkpoint, interrupted = None, False
    state.start_clock()
    model.train()
    try:
        with stop_requests() as stop:
            for step in range(first_step, cfg.steps.max_steps):
                lr = set_lr(state.optimizer, lr_at(step, cfg))
                started = time.perf_counter()
                batches = micro_batches(train_ids, state.generator, cfg, info, T)
                loss = train_step(par, state.optimizer, state.scaler, batches, cfg, autocast, norms)
                stopping = agree_across_ranks(loss, bool(stop), info)
                value = _check_finite(loss.item(), step, lr, run_dir)
                if on_step is not None:
                    on_step(time.perf_counter() - started)
                state.add_loss(value)
                metrics.log_step(state, lr, value, validate, norms.pop())
                if stopping:  # what the ranks agreed, not `stop`, which may have grown since
                    interrupted = True
                    break
                if _checkpoint_due(state.step, cfg, run_dir):
                    checkpoint = state.save(run_dir, checkpoint_files)
            if run_dir is not None:
                checkpoint = state.save(run_dir, checkpoint_files)
    finally:
        metrics.close()
    rate = (state.step - first_step) * state.tokens_per_step / max(state.run_seconds(), 1e-9)
    if interrupted:
        saved = f"; checkpoint saved to {checkpoint}" if checkpoint else ""
        log(f"stopped by signal after step {state.step}{saved}")
    val_loss = None
    if not interrupted:  # the whole split, evaluated once
        n_windows = len(scored_windows(val_ids, T))
        val_loss = _whole_split_loss(metrics.records, state.step, eval_windows, n_windows)
        if val_loss is None:
            val_loss = evaluate(model, val_ids, None, batch_size, autocast)
    elapsed = state.elapsed()
    return TrainResult(
        val_loss, metrics.records, elapsed, rate, state.step, interrupted, checkpoint
    )
