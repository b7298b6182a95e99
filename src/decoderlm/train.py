"""The training loop, and the seed experiment end to end (`run_experiment`).

Training is next-token prediction with teacher forcing: every position of a random window of
block_size + 1 tokens predicts the token after it, in parallel, and the mean cross-entropy
(nats) is minimised with AdamW, a linear warm-up then cosine decay of the learning rate, and
gradient-norm clipping.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_optimizer_state_dict)

from .training.checkpoints import latest_checkpoint, load_trainer_state, save_checkpoint
from .weights import list_checkpoints
from .generate import generate
from .hooks import run_with_cache
from .config import ModelConfig, TrainConfig
from .files import atomic_write, read_json
from .data import SEED_CROP_CHARS, check_split, is_token_dir, load_text, split_ids, windows
from .model import DecoderLM
from .presets import get_preset
from .tokenizers import DEFAULT_UNK_TOKEN, CharTokenizer, load_tokenizer

__all__ = ["train", "lr_at", "evaluate", "configure_optimizer", "run_experiment", "TrainResult",
           "RunSummary", "DistInfo", "init_distributed", "load_corpus", "LN2"]

LN2 = math.log(2.0)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based).

    "constant": cfg.lr. "cosine": linear warm-up lr * (step + 1) / warmup_steps over the first
    warmup_steps steps, then min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2 with
    progress going from 0 to 1 over the steps up to decay_steps (default max_steps), then 1
    (Loshchilov & Hutter 2017, eq. 5).
    """
    if cfg.schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, (cfg.decay_steps or cfg.max_steps) - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def configure_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) with decoupled weight decay on every parameter of 2 or
    more dimensions and none on biases and norm gains (1-D).

    Embeddings are decayed too, as in nanoGPT: with tied weights the token embedding is also
    the unembedding matrix, a weight matrix like any other, and the learned position table is
    a [block_size, d_model] matrix whose unused rows decay towards 0 instead of staying at
    their random initial values. Biases and gains are not decayed: pulling a LayerNorm gain
    towards 0 rather than 1 would fight the normalisation.

    The fused AdamW kernel (one kernel for all parameters) is used on CPU and CUDA; FSDP's
    sharded parameters use the default multi-tensor implementation.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = not cfg.fsdp and all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=(cfg.beta1, cfg.beta2),
                             fused=fused)


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.dtype in ("bfloat16", "float16"):
        return torch.autocast(device_type=device.type, dtype=getattr(torch, cfg.dtype))
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: DecoderLM, data: torch.Tensor, max_windows: int | None = None,
             batch_size: int = 32, autocast=contextlib.nullcontext) -> float:
    """Mean next-token loss (nats per token) over non-overlapping block_size windows of data.

    Deterministic: the windows start at 0, T, 2T, ... (all of them, or max_windows of them
    spread evenly over the split). The model runs in eval mode (no dropout) and its previous
    mode is restored afterwards.

    Args:
        model: the DecoderLM.
        data: [N] int64 token ids, N > block_size.
        max_windows: evaluate at most this many windows (None: every window).
        batch_size: windows per forward pass.
        autocast: a context-manager factory, e.g. bfloat16 autocast.

    Raises:
        ValueError: data is too short for one window.
    """
    T = model.config.block_size
    check_split("evaluation", data, T)
    n_windows = (len(data) - 1) // T
    starts = torch.arange(n_windows) * T
    if max_windows is not None and n_windows > max_windows:
        starts = starts[torch.linspace(0, n_windows - 1, max_windows).long()]
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        device = model.device
        for chunk in starts.split(batch_size):
            x, y = windows(data, chunk, T)
            with autocast():
                _, loss = model(x.to(device), y.to(device))
            total += float(loss) * y.numel()
            count += y.numel()
    finally:
        model.train(was_training)
    return total / count


@dataclass(frozen=True)
class DistInfo:
    """This process's place in a torchrun job; rank 0 of 1 without torchrun."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Only rank 0 writes files and prints."""
        return self.rank == 0


def init_distributed(device: str | None = None) -> tuple[DistInfo, torch.device]:
    """Join the torchrun job described by the RANK / LOCAL_RANK / WORLD_SIZE environment
    variables (process group backend: nccl on CUDA, gloo on CPU), or run alone without them.

    Returns:
        (DistInfo, the torch.device of this process: cuda:LOCAL_RANK on CUDA).
    """
    kind = (device or ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistInfo(), torch.device(device or kind)
    info = DistInfo(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world)
    target = torch.device(kind, info.local_rank) if kind == "cuda" else torch.device(kind)
    if kind == "cuda":
        torch.cuda.set_device(target)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    return info, target


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


def _rng_state() -> dict:
    """Every RNG this process draws from: Python, NumPy, torch CPU and CUDA."""
    np_state = np.random.get_state(legacy=False)
    return {"python": random.getstate(),
            "numpy": {**np_state, "state": {"key": torch.from_numpy(
                np_state["state"]["key"].astype(np.int64)), "pos": np_state["state"]["pos"]}},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state({**np_state, "state": {
        "key": np_state["state"]["key"].numpy().astype(np.uint32),
        "pos": np_state["state"]["pos"]}})
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def _stop_requests():
    """While active, SIGINT and SIGTERM only set a flag (read by the training loop, which
    then saves a checkpoint and stops). Outside the main thread signals cannot be caught."""
    requested: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: requested.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requested
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wrap(model: DecoderLM, cfg: TrainConfig, info: DistInfo, device: torch.device):
    """(the module to call for training steps, the DDP wrapper or None). FSDP2 shards `model`
    in place (each block, then the root); DDP wraps it; torch.compile goes outside both."""
    if cfg.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    ddp = None
    if cfg.fsdp:
        if info.world_size == 1 and not dist.is_initialized():
            raise ValueError("fsdp needs several processes: run under torchrun, or set "
                             "fsdp false")
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        step_model = model
    elif info.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
        step_model = ddp
    else:
        step_model = model
    if cfg.compile:
        step_model = torch.compile(step_model)
    return step_model, ddp


def _sync_gradients(model: DecoderLM, ddp, cfg: TrainConfig, last: bool):
    """Gradient synchronisation for one micro-step: across ranks only on the last micro-step
    of the optimizer step. DDP decides in forward whether its backward all-reduces, so the
    context must cover forward and backward (pitfalls row 22)."""
    if cfg.fsdp:
        model.set_requires_gradient_sync(last)
    if ddp is not None and not last:
        return ddp.no_sync()
    return contextlib.nullcontext()


def train(model: DecoderLM, cfg: TrainConfig, train_ids, val_ids,
          run_dir: str | Path | None = None, progress: bool = True,
          info: DistInfo = DistInfo(), resume: dict | None = None,
          checkpoint_files: dict | None = None, log=print) -> TrainResult:
    """Train `model` in place: AdamW, warm-up + cosine schedule, clipping, mixed precision,
    gradient accumulation, checkpoints, and DDP / FSDP2 under torchrun.

    Each optimizer step draws grad_accum_steps micro-batches; every micro-step draws
    batch_size * world_size window starts from one generator seeded identically on every
    rank, and rank r trains on the r-th slice. So N processes with batch_size b see exactly
    the windows of one process with batch_size N * b, and the union of their (averaged)
    gradients is that process's gradient.

    Args:
        model: the DecoderLM, already on this process's device.
        cfg: the TrainConfig.
        train_ids, val_ids: [N] token ids (int64 tensors, or numpy / memmapped arrays).
        run_dir: where metrics.jsonl and checkpoints/ go (rank 0 writes); None keeps nothing
            and saves no checkpoints.
        progress: show a tqdm progress bar on stderr (rank 0).
        info: this process's DistInfo (see `init_distributed`).
        resume: the trainer state of a checkpoint to continue from (`load_trainer_state`):
            optimizer, step, tokens, RNG states, data sampler and loss scaler are restored
            (the model weights must already be the checkpoint's).
        checkpoint_files: what each checkpoint stores besides the trainer state:
            {"extra": config.json entries, "tokenizer": a tokenizer}.
        log: print function for messages (rank 0).

    metrics.jsonl gets one JSON object per logged step: step (optimizer steps done),
    train_loss (mean over the steps since the last record and over all ranks, nats), lr,
    tokens (seen so far, all ranks), elapsed_s, tokens_per_s, and on evaluation steps
    val_loss (nats) and val_bpc (val_loss / ln 2, bits per token).

    SIGINT / SIGTERM during training: the current step finishes, a checkpoint is saved and
    the result says interrupted=True.

    Returns:
        TrainResult; val_loss covers the whole validation split (None if interrupted).

    Raises:
        ValueError: a split is shorter than block_size + 1 tokens, or the loss becomes NaN or
            inf (the last good checkpoint is left in place).
    """
    T = model.config.block_size
    check_split("train", train_ids, T)
    check_split("validation", val_ids, T)
    device = model.device
    run_dir = Path(run_dir) if run_dir is not None else None
    log = log if info.is_main else (lambda *a, **k: None)
    step_model, ddp = _wrap(model, cfg, info, device)
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = configure_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "float16")
    autocast = lambda: _autocast(cfg, device)  # noqa: E731
    eval_windows = cfg.eval_batches * cfg.batch_size * info.world_size  # as one process
    tokens_per_step = cfg.batch_size * cfg.grad_accum_steps * info.world_size * T
    first_step, elapsed_before, loss_sum, loss_n = 0, 0.0, 0.0, 0
    if resume is not None:
        state = resume
        first_step, elapsed_before = state["step"], state["elapsed_s"]
        loss_sum, loss_n = state["loss_sum"], state["loss_n"]
        set_optimizer_state_dict(model, optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        generator.set_state(state["data_sampler"])
        if state["scaler"]:
            scaler.load_state_dict(state["scaler"])
        rngs = state["rng"]
        if len(rngs) != info.world_size:
            log(f"warning: the checkpoint was written by {len(rngs)} process(es) and this run "
                f"has {info.world_size}; dropout draws differ from an uninterrupted run")
        _set_rng_state(rngs[info.rank % len(rngs)])
        if first_step > cfg.max_steps or (first_step == cfg.max_steps and run_dir is not None
                                           and (run_dir / "model.safetensors").exists()):
            raise ValueError(f"the checkpoint is at step {first_step} and "
                             f"max_steps is {cfg.max_steps}; pass a larger --max-steps to "
                             f"train further")

    def save(step: int) -> Path | None:
        """A checkpoint of the state after `step` optimizer steps (every rank takes part)."""
        model_state, optim_state = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        rngs = [_rng_state()]
        if info.world_size > 1:
            rngs = [None] * info.world_size
            dist.all_gather_object(rngs, _rng_state())
        path = None
        if info.is_main and run_dir is not None:
            files = checkpoint_files or {}
            trainer_state = {
                "step": step, "tokens": step * tokens_per_step, "elapsed_s": elapsed(),
                "loss_sum": loss_sum, "loss_n": loss_n, "optimizer": optim_state,
                "data_sampler": generator.get_state(), "rng": rngs,
                "scaler": scaler.state_dict() if scaler.is_enabled() else {},
                "world_size": info.world_size, "train": cfg.to_dict()}
            try:
                path = save_checkpoint(run_dir, step, {
                    "model": (model_state, model.config, files.get("extra")),
                    "tokenizer": files.get("tokenizer"), "trainer_state": trainer_state},
                    cfg.keep_checkpoints)
            except OSError as e:
                last_good = list_checkpoints(run_dir)[-1:]
                raise OSError(f"saving the checkpoint of step {step} failed: {e}"
                              + (f"; the last good checkpoint is {last_good[0]}"
                                 if last_good else "")) from None
        if info.world_size > 1:
            dist.barrier()
        return path

    metrics: list[dict] = []
    sink = None
    if info.is_main and run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        sink = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
    from tqdm.auto import tqdm
    bar = tqdm(total=cfg.max_steps, initial=first_step, disable=not (progress and info.is_main),
               unit="step", mininterval=0.5, dynamic_ncols=True)
    start = time.perf_counter()
    elapsed = lambda: elapsed_before + time.perf_counter() - start  # noqa: E731
    model.train()
    done, checkpoint, interrupted = first_step, None, False
    try:
        with _stop_requests() as stop:
            for step in range(first_step, cfg.max_steps):
                lr = lr_at(step, cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                step_loss = torch.zeros((), device=device)
                for micro in range(cfg.grad_accum_steps):
                    starts = torch.randint(len(train_ids) - T, (cfg.batch_size * info.world_size,),
                                           generator=generator)
                    x, y = windows(train_ids, starts[info.rank * cfg.batch_size:
                                                     (info.rank + 1) * cfg.batch_size], T)
                    last = micro == cfg.grad_accum_steps - 1
                    with _sync_gradients(model, ddp, cfg, last):
                        with autocast():
                            _, loss = step_model(x.to(device), y.to(device))
                        scaler.scale(loss / cfg.grad_accum_steps).backward()
                    step_loss += loss.detach()
                if cfg.grad_clip is not None:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                step_loss /= cfg.grad_accum_steps
                if info.world_size > 1:
                    flags = torch.tensor([float(bool(stop))], device=device)
                    dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                    if flags.item() and not stop:
                        stop.append(signal.SIGTERM)
                loss_value = step_loss.item()
                if not math.isfinite(loss_value):
                    last_good = list_checkpoints(run_dir)[-1:] if run_dir else []
                    raise ValueError(
                        f"the training loss became {loss_value} at step {step + 1} (lr "
                        f"{lr:.3g}); try a lower learning rate, weight decay or float32"
                        + (f"; the last good checkpoint is {last_good[0]}" if last_good else ""))
                loss_sum, loss_n = loss_sum + loss_value, loss_n + 1
                done = step + 1
                tokens = done * tokens_per_step
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}",
                                tok_s=f"{tokens / max(elapsed(), 1e-9):,.0f}", refresh=False)
                is_eval = done % cfg.eval_interval == 0 or done == cfg.max_steps
                if done % cfg.log_interval == 0 or is_eval:
                    record = {"step": done, "train_loss": loss_sum / loss_n, "lr": lr,
                              "tokens": tokens, "elapsed_s": round(elapsed(), 3),
                              "tokens_per_s": round(tokens / elapsed(), 1)}
                    loss_sum, loss_n = 0.0, 0
                    if is_eval:
                        val = evaluate(model, val_ids, eval_windows, cfg.batch_size, autocast)
                        record.update(val_loss=val, val_bpc=val / LN2)
                        if info.is_main:
                            bar.write(f"step {done:>6}: train {record['train_loss']:.4f}, "
                                      f"val {val:.4f} nats ({val / LN2:.3f} bits/token)")
                    metrics.append(record)
                    if sink:
                        sink.write(json.dumps(record) + "\n")
                        sink.flush()
                if stop:
                    interrupted = True
                    break
                if run_dir is not None and cfg.checkpoint_interval \
                        and done % cfg.checkpoint_interval == 0 and done < cfg.max_steps:
                    checkpoint = save(done)
            if run_dir is not None:
                checkpoint = save(done)
    finally:
        bar.close()
        if sink:
            sink.close()
    run_s = time.perf_counter() - start
    rate = (done - first_step) * tokens_per_step / max(run_s, 1e-9)
    if interrupted:
        log(f"stopped by signal after step {done}"
            + (f"; checkpoint saved to {checkpoint}" if checkpoint else ""))
        return TrainResult(None, metrics, elapsed(), rate, done, True, checkpoint)
    val_loss = evaluate(model, val_ids, None, cfg.batch_size, autocast)
    return TrainResult(val_loss, metrics, elapsed(), rate, done, False, checkpoint)


def _free_run_dir(name: str, root: Path = Path("runs")) -> Path:
    """runs/<name>, or runs/<name>-2, -3, ... if it is taken: never overwrite a run."""
    candidate, n = root / name, 1
    while candidate.exists():
        n += 1
        candidate = root / f"{name}-{n}"
    return candidate


@dataclass
class RunSummary:
    """What `run_experiment` returns; val_loss and val_bpc are None for an interrupted run."""

    out_dir: Path
    val_loss: float | None
    val_bpc: float | None
    elapsed_s: float
    tokens_per_s: float
    data_source: str
    step: int = 0
    interrupted: bool = False


def _data_spec(data, dataset, max_chars, val_fraction) -> dict:
    """Where a run's corpus comes from, as stored in config.json["data_spec"] (read back by
    `--resume` and `decoderlm eval --split`)."""
    if max_chars is None and (dataset is not None or (data is not None and Path(data).is_dir()
                                                      and not is_token_dir(data))):
        max_chars = SEED_CROP_CHARS
    path = None if data is None else str(Path(data).resolve())
    token_dir = path if data is not None and is_token_dir(data) else None
    return {"path": path, "dataset": dataset,
            "max_chars": max_chars or None, "token_dir": token_dir, "val_fraction": val_fraction}


def load_corpus(spec: dict, tokenizer=None):
    """The corpus of a data_spec: (tokenizer, train ids, validation ids, description,
    fingerprint).

    A prepared token directory (`decoderlm prepare`) is memory-mapped and brings its own
    tokenizer and split; text is encoded with `tokenizer` (a new CharTokenizer of the text,
    with an unknown-character id, when None) and split by spec["val_fraction"] (the last part
    is validation). The fingerprint is the sha256 of the text, or of the token directory's
    meta.json (which holds its sources' sha256 and counts): `--resume` compares it with the
    checkpoint's to notice a corpus that changed.
    """
    if spec.get("token_dir"):
        from .data import META_NAME, load_token_dir

        tokens = load_token_dir(spec["token_dir"])
        if len(tokens.val) == 0:
            raise ValueError(f"token directory {spec['token_dir']} has no validation tokens (it "
                             f"was prepared with --val-fraction 0); training scores a "
                             f"validation split: run `decoderlm prepare` again with "
                             f"--val-fraction 0.1")
        fingerprint = hashlib.sha256((Path(spec["token_dir"]) / META_NAME).read_bytes())
        return (tokens.tokenizer, tokens.train, tokens.val,
                f"{spec['token_dir']} (prepared {type(tokens.tokenizer).__name__} tokens)",
                fingerprint.hexdigest())
    text, source = load_text(spec["path"], spec["max_chars"], spec["dataset"])
    if tokenizer is None:
        tokenizer = CharTokenizer.from_text(text, unk_token=DEFAULT_UNK_TOKEN)
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    train_ids, val_ids = split_ids(ids, spec["val_fraction"])
    return (tokenizer, train_ids, val_ids, f"{source}: {len(text):,} characters",
            hashlib.sha256(text.encode("utf-8")).hexdigest())


def _resume_point(run_dir: Path, info: DistInfo, log):
    """(checkpoint, its trainer state, model and tokenizer) for the newest checkpoint of
    run_dir that loads whole. A damaged newer one is skipped with a warning and renamed
    damaged-step-N (by rank 0), so it stays on disk for inspection but out of the
    keep_checkpoints rotation."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--resume {run_dir} is a file; give the run directory")
    latest_checkpoint(run_dir)  # raises a clear error when there is none
    for candidate in reversed(list_checkpoints(run_dir)):
        try:
            return (candidate, load_trainer_state(candidate), DecoderLM.from_pretrained(candidate),
                    load_tokenizer(candidate))
        except (ValueError, FileNotFoundError) as e:
            log(f"warning: skipping checkpoint {candidate}: {e}")
            if info.is_main:
                os.replace(candidate, candidate.with_name("damaged-" + candidate.name))
    raise ValueError(f"no checkpoint in {run_dir / 'checkpoints'} can be loaded; see the "
                     f"warnings above")


def _check_same(kind: str, saved: dict, overrides: dict) -> None:
    """Raise ValueError naming each command-line value that contradicts the checkpoint."""
    clashes = [f"{k} is {saved.get(k)!r} in the checkpoint but {v!r} here"
               for k, v in overrides.items() if saved.get(k) != v]
    if clashes:
        raise ValueError(f"the checkpoint's {kind} does not match the command line: "
                         f"{'; '.join(clashes)}; drop those options to resume, or start a new "
                         f"run with --out")


def run_experiment(preset: str | None = None, data: str | Path | None = None,
                   out: str | Path | None = None, overwrite: bool = False,
                   max_chars: int | None = None, dataset: str | None = None,
                   model_overrides: dict | None = None, train_overrides: dict | None = None,
                   device: str | None = None, progress: bool = True,
                   log=print, resume: str | Path | None = None) -> RunSummary:
    """Train a DecoderLM end to end (the seed experiment by default), then sample and plot.

    Reads the corpus (the embedded WikiText-2 crop by default, a text file, or a directory
    prepared by `decoderlm prepare`), builds the character vocabulary of text corpora,
    splits 90/10, trains with the preset's settings plus overrides, and writes into the run
    directory: metrics.jsonl and checkpoints/ while training, then model.safetensors,
    config.json, tokenizer.json, loss.png, attention.png (every layer and head on the first 64
    validation tokens) and samples.txt (sample_chars tokens from sample_prompt).

    Under torchrun every process calls this; rank 0 alone writes files and prints.

    Args:
        preset: a name from `decoderlm.presets.PRESETS` (default "default").
        data, dataset, max_chars: see `decoderlm.data.load_text`; max_chars defaults to the
            seed notebook's 300,000 for a WikiText directory or dataset, all of a plain file.
        out: the run directory; None picks runs/<preset> (or -2, -3, ... if taken).
        overwrite: allow `out` to hold an earlier run, whose files (only those) are deleted
            after every check, just before training.
        model_overrides, train_overrides: ModelConfig / TrainConfig fields to change.
        device: "cpu", "cuda", ...; None picks CUDA when available.
        resume: a run directory to continue from its newest complete checkpoint; its model
            config, preset and data are reused (contradicting overrides are refused), training
            settings may be overridden (e.g. max_steps), and metrics.jsonl is appended to.

    Raises:
        ValueError / FileNotFoundError: bad settings, data or checkpoints (messages say what
            to change).
    """
    model_overrides, train_overrides = dict(model_overrides or {}), dict(train_overrides or {})
    info, device = init_distributed(device)
    log = log if info.is_main else (lambda *a, **k: None)
    checkpoint = resume_state = None
    if resume is not None:
        out_dir = Path(resume)
        if out is not None and Path(out).resolve() != out_dir.resolve():
            raise ValueError(f"--resume continues the run in {out_dir} itself; drop --out "
                             f"{out} (copy the run directory first to branch it)")
        checkpoint, resume_state, resumed, tokenizer = _resume_point(out_dir, info, log)
        saved = read_json(checkpoint / "config.json")
        if preset is not None and preset != saved.get("preset"):
            raise ValueError(f"the checkpoint was trained with preset {saved.get('preset')!r}, "
                             f"not {preset!r}; drop --preset to resume")
        preset, spec = saved.get("preset"), saved.get("data_spec")
        if not isinstance(spec, dict):
            raise ValueError(f"{checkpoint / 'config.json'} has no data_spec entry")
        _check_same("data", spec, {k: v for k, v in (("dataset", dataset),
                                                      ("max_chars", max_chars),
                                                      ("val_fraction",
                                                       train_overrides.get("val_fraction")))
                                   if v is not None})
        if data is not None:  # the same corpus, moved: checked by its fingerprint below
            moved = str(Path(data).resolve())
            spec = {**spec, "path": moved, "token_dir": moved if spec.get("token_dir") else None}
        _check_same("model config", saved["model"], model_overrides)
        model_cfg = ModelConfig.from_dict(saved["model"])
        train_cfg = TrainConfig.from_dict({**saved["train"], **train_overrides})
        tokenizer, train_ids, val_ids, source, fingerprint = load_corpus(spec, tokenizer)
        if spec.get("fingerprint") not in (None, fingerprint):
            raise ValueError(f"the corpus at {spec['token_dir'] or spec['path']} is not the one "
                             f"the checkpoint was trained on (its sha256 differs); restore it, "
                             f"pass --data with the original, or start a new run")
        old_decay = saved["train"].get("decay_steps") or saved["train"]["max_steps"]
        new_decay = train_cfg.decay_steps or train_cfg.max_steps
        if train_cfg.schedule == "cosine" and new_decay != old_decay:
            log(f"note: the cosine schedule now decays over {new_decay} steps instead of "
                f"{old_decay}; pass --decay-steps {old_decay} to keep the original schedule")
    else:
        preset = preset or "default"
        preset_spec = get_preset(preset)
        train_cfg = TrainConfig.from_dict({**preset_spec.train, **train_overrides})
        spec = _data_spec(data, dataset, max_chars, train_cfg.val_fraction)
        if spec["token_dir"] and (max_chars or "val_fraction" in train_overrides):
            raise ValueError("--max-chars and --val-fraction do not apply to a prepared token "
                             "directory: its split was fixed by `decoderlm prepare` (run it "
                             "again with --val-fraction)")
        tokenizer, train_ids, val_ids, source, fingerprint = load_corpus(spec)
        spec["fingerprint"] = fingerprint
        model_cfg = ModelConfig.from_dict({**preset_spec.model, **model_overrides,
                                           "vocab_size": tokenizer.vocab_size})
        out_dir = Path(out) if out is not None else _free_run_dir(preset)
    if train_cfg.fsdp and info.world_size == 1:
        raise ValueError("fsdp needs several processes: run under torchrun (`torchrun "
                         "--nproc_per_node N -m decoderlm train ...`), or pass --fsdp false to "
                         "train (or resume) in one process")
    check_split("train", train_ids, model_cfg.block_size)
    check_split("validation", val_ids, model_cfg.block_size)
    _check_run_dir(out_dir, overwrite, checkpoint)  # on every rank: all fail alike
    if info.is_main:
        _prepare_run_dir(out_dir, None if resume_state is None else resume_state["step"], log)
    if info.world_size > 1:
        dist.barrier()

    torch.manual_seed(train_cfg.seed)
    model = (resumed if checkpoint is not None else DecoderLM(model_cfg)).to(device)
    if info.world_size > 1:  # the same initial weights everywhere, different dropout per rank
        torch.manual_seed(train_cfg.seed + info.rank)
    log(f"data: {source}, vocabulary {tokenizer.vocab_size}, train {len(train_ids):,} / "
        f"validation {len(val_ids):,} tokens")
    log(f"model: {model.num_parameters():,} parameters (n_layers {model_cfg.n_layers}, "
        f"d_model {model_cfg.d_model}, n_heads {model_cfg.n_heads}, block_size "
        f"{model_cfg.block_size}); preset {preset!r}, {train_cfg.max_steps} steps, "
        f"{train_cfg.dtype} on {device}" + (f" x {info.world_size} processes"
                                            if info.world_size > 1 else "")
        + (f"; resuming from {checkpoint}" if checkpoint else ""))
    extra = {"train": train_cfg.to_dict(), "preset": preset, "data": source, "data_spec": spec}
    result = train(model, train_cfg, train_ids, val_ids, out_dir, progress, info,
                   resume=resume_state,
                   checkpoint_files={"extra": extra, "tokenizer": tokenizer}, log=log)
    if result.interrupted:
        log(f"resume with: decoderlm train --resume {out_dir}")
        return RunSummary(out_dir, None, None, result.elapsed_s, result.tokens_per_s, source,
                          result.step, True)
    if info.is_main:
        final = DecoderLM.from_pretrained(result.checkpoint, map_location=str(device)) \
            if info.world_size > 1 else model
        final.save_pretrained(out_dir, extra)
        tokenizer.save_pretrained(out_dir)
        metrics = [json.loads(line) for line in
                   (out_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
        _write_artifacts(final, tokenizer, train_cfg, metrics, val_ids, out_dir, log)
    summary = RunSummary(out_dir, result.val_loss, result.val_loss / LN2, result.elapsed_s,
                         result.tokens_per_s, source, result.step)
    unit = "char" if isinstance(tokenizer, CharTokenizer) else "token"
    log(f"final validation loss {summary.val_loss:.4f} nats/{unit} = {summary.val_bpc:.4f} "
        f"bits/{unit} (whole validation split), {result.elapsed_s:.1f} s of training at "
        f"{result.tokens_per_s:,.0f} tokens/s")
    log(f"wrote {out_dir}/: model.safetensors config.json tokenizer.json metrics.jsonl "
        f"loss.png attention.png samples.txt checkpoints/")
    return summary


_RUN_FILES = ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", "loss.png",
              "attention.png", "samples.txt", "checkpoints")


def _check_run_dir(out_dir: Path, overwrite: bool, checkpoint: Path | None) -> None:
    """Refuse an --out that is a file, is not writable, or holds an earlier run (unless
    --overwrite or resuming it)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a directory")
    held = [name for name in _RUN_FILES if (out_dir / name).exists()]
    if checkpoint is None and held and not overwrite:
        raise ValueError(f"{out_dir} already holds a run ({', '.join(held)}); pass --resume "
                         f"{out_dir} to continue it, --overwrite to replace it, or choose "
                         f"another --out")
    existing = next(p for p in (out_dir / "checkpoints", out_dir, *out_dir.parents)
                    if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write into {existing} (permission denied); choose another "
                         f"--out or fix its permissions")


def _prepare_run_dir(out_dir: Path, resumed_step: int | None, log) -> None:
    """Make out_dir ready (rank 0). A new run deletes the files of an earlier run there (only
    those: other files in the directory stay); a resumed run keeps metrics.jsonl up to the
    checkpoint's step, dropping later records and a line torn by a crash."""
    if resumed_step is None:
        for name in _RUN_FILES:
            path = out_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        out_dir.mkdir(parents=True, exist_ok=True)
        return
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file():
        kept = []
        for line in metrics.read_bytes().decode("utf-8", errors="replace").splitlines(True):
            try:
                if json.loads(line).get("step", 0) <= resumed_step:
                    kept.append(line)
            except (ValueError, AttributeError):  # torn or damaged: left out, said once
                log(f"warning: dropping an unreadable line of {metrics}: {line[:60]!r}")
        atomic_write(metrics, lambda tmp: Path(tmp).write_text("".join(kept), encoding="utf-8"))


def _write_artifacts(model, tokenizer, cfg: TrainConfig, metrics: list[dict], val_ids,
                     out_dir: Path, log=print) -> None:
    from .plots import plot_attention, plot_loss

    plot_loss(metrics, out_dir / "loss.png")
    n = min(64, model.config.block_size, len(val_ids))
    window = torch.tensor(np.asarray(val_ids[:n], dtype=np.int64))[None, :]
    device = model.device
    model.eval()
    with torch.no_grad():
        _, cache = run_with_cache(model, window.to(device), ["hook_pattern"])
        att = torch.stack(list(cache.values()))
    plot_attention(att[:, 0].cpu().numpy(), out_dir / "attention.png",
                   title=f"attention on validation tokens 0-{n - 1}: "
                         f"{tokenizer.decode(window[0])!r}")
    try:
        prompt = tokenizer.encode(cfg.sample_prompt)
    except ValueError:  # the prompt has characters outside a character vocabulary
        prompt = []
        log(f"note: sample_prompt {cfg.sample_prompt!r} has characters outside the vocabulary; "
            f"samples.txt starts from the first validation token instead")
    idx = torch.tensor([prompt or window[0, :1].tolist()], dtype=torch.long)
    out = generate(model, idx.to(device), cfg.sample_chars, seed=cfg.seed)
    (out_dir / "samples.txt").write_text(tokenizer.decode(out[0]), encoding="utf-8")
