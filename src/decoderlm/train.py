"""The training loop, and the seed experiment end to end (`run_experiment`).

Training is next-token prediction with teacher forcing: every position of a random window of
block_size + 1 tokens predicts the token after it, in parallel, and the mean cross-entropy
(nats) is minimised with AdamW, a linear warm-up then cosine decay of the learning rate, and
gradient-norm clipping.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig, TrainConfig, get_preset
from .data import check_split, get_batch, load_text, split_ids, windows
from .model import DecoderLM
from .tokenizers import CharTokenizer

__all__ = ["train", "lr_at", "evaluate", "configure_optimizer", "run_experiment", "TrainResult",
           "LN2"]

LN2 = math.log(2.0)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based).

    "constant": cfg.lr. "cosine": linear warm-up lr * (step + 1) / warmup_steps over the first
    warmup_steps steps, then min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2 with
    progress going from 0 to 1 over the remaining steps (Loshchilov & Hutter 2017, eq. 5).
    """
    if cfg.schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.max_steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def configure_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on every parameter of 2 or more dimensions (weight matrices and
    embeddings, as nanoGPT does) and none on biases and LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=(cfg.beta1, cfg.beta2))


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
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
        device = model.lm_head.weight.device
        for chunk in starts.split(batch_size):
            x, y = windows(data, chunk, T)
            with autocast():
                _, loss = model(x.to(device), y.to(device))
            total += float(loss) * y.numel()
            count += y.numel()
    finally:
        model.train(was_training)
    return total / count


@dataclass
class TrainResult:
    """What `train` returns: the final full-split validation loss and the logged records."""

    val_loss: float
    metrics: list[dict]
    elapsed_s: float
    tokens_per_s: float


def train(model: DecoderLM, cfg: TrainConfig, train_ids: torch.Tensor, val_ids: torch.Tensor,
          metrics_path: str | Path | None = None, progress: bool = True) -> TrainResult:
    """Train `model` in place.

    Args:
        model: the DecoderLM (its device is used).
        cfg: the TrainConfig.
        train_ids, val_ids: [N] int64 token ids of the two splits.
        metrics_path: metrics.jsonl to append one JSON object per logged step: step (1-based
            count of optimizer steps done), train_loss (mean over the steps since the last
            record, nats), lr, tokens (seen so far), elapsed_s, tokens_per_s, and on evaluation
            steps val_loss (nats) and val_bpc (val_loss / ln 2, bits per token).
        progress: show a tqdm progress bar on stderr.

    Returns:
        TrainResult with the validation loss over the whole validation split at the end.

    Raises:
        ValueError: a split is shorter than block_size + 1 tokens, or the loss becomes NaN/inf.
    """
    T = model.config.block_size
    check_split("train", train_ids, T)
    check_split("validation", val_ids, T)
    device = model.lm_head.weight.device
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = configure_optimizer(model, cfg)
    autocast = lambda: _autocast(cfg, device)  # noqa: E731
    eval_windows = cfg.eval_batches * cfg.batch_size
    metrics: list[dict] = []
    sink = open(metrics_path, "a", encoding="utf-8") if metrics_path else None

    from tqdm.auto import tqdm
    bar = tqdm(total=cfg.max_steps, disable=not progress, unit="step", mininterval=0.5,
               dynamic_ncols=True)
    model.train()
    start = time.perf_counter()
    loss_sum, loss_n = 0.0, 0
    try:
        for step in range(cfg.max_steps):
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = get_batch(train_ids, cfg.batch_size, T, generator)
            with autocast():
                _, loss = model(x.to(device), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            loss_value = loss.item()
            if not math.isfinite(loss_value):
                raise ValueError(f"the training loss became {loss_value} at step {step + 1} "
                                 f"(lr {lr:.3g}); try a lower learning rate, weight decay or "
                                 f"float32; metrics so far are in {metrics_path}")
            loss_sum, loss_n = loss_sum + loss_value, loss_n + 1
            done = step + 1
            elapsed = time.perf_counter() - start
            tokens = done * cfg.batch_size * T
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens / elapsed:,.0f}",
                            refresh=False)
            is_eval = done % cfg.eval_interval == 0 or done == cfg.max_steps
            if done % cfg.log_interval == 0 or is_eval:
                record = {"step": done, "train_loss": loss_sum / loss_n, "lr": lr,
                          "tokens": tokens, "elapsed_s": round(elapsed, 3),
                          "tokens_per_s": round(tokens / elapsed, 1)}
                loss_sum, loss_n = 0.0, 0
                if is_eval:
                    val = evaluate(model, val_ids, eval_windows, cfg.batch_size, autocast)
                    record.update(val_loss=val, val_bpc=val / LN2)
                    bar.write(f"step {done:>6}: train {record['train_loss']:.4f}, "
                              f"val {val:.4f} nats ({val / LN2:.3f} bits/token)")
                metrics.append(record)
                if sink:
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
    finally:
        bar.close()
        if sink:
            sink.close()
    elapsed = time.perf_counter() - start
    val_loss = evaluate(model, val_ids, None, cfg.batch_size, autocast)
    return TrainResult(val_loss=val_loss, metrics=metrics, elapsed_s=elapsed,
                       tokens_per_s=cfg.max_steps * cfg.batch_size * T / elapsed)


def _free_run_dir(name: str, root: Path = Path("runs")) -> Path:
    """runs/<name>, or runs/<name>-2, -3, ... if it is taken: never overwrite a run."""
    candidate, n = root / name, 1
    while candidate.exists():
        n += 1
        candidate = root / f"{name}-{n}"
    return candidate


@dataclass
class RunSummary:
    """What `run_experiment` returns."""

    out_dir: Path
    val_loss: float
    val_bpc: float
    elapsed_s: float
    tokens_per_s: float
    data_source: str


def run_experiment(preset: str = "default", data: str | Path | None = None,
                   out: str | Path | None = None, overwrite: bool = False,
                   max_chars: int | None = None, dataset: str | None = None,
                   model_overrides: dict | None = None, train_overrides: dict | None = None,
                   device: str | None = None, progress: bool = True,
                   log=print) -> RunSummary:
    """The seed experiment: train a character-level DecoderLM, then sample and plot it.

    Reads the corpus (the embedded WikiText-2 crop by default), builds the character
    vocabulary, splits 90/10, trains with the preset's settings (plus overrides), and writes
    into the run directory: model.safetensors, config.json, tokenizer.json, metrics.jsonl,
    loss.png, attention.png (every layer and head on the first 64 validation characters) and
    samples.txt (sample_chars characters from sample_prompt). The files are written into
    <out>.partial first and moved into `out` at the end: a run that fails (or is interrupted)
    leaves its metrics in <out>.partial and never touches `out`.

    Args:
        preset: a name from `decoderlm.config.PRESETS`.
        data, dataset, max_chars: see `decoderlm.data.load_text`; max_chars defaults to the
            seed notebook's 300,000 for a WikiText directory or dataset, all of a plain file.
        out: the run directory; None picks runs/<preset> (or -2, -3, ... if taken).
        overwrite: allow `out` to hold an earlier run (otherwise ValueError).
        model_overrides, train_overrides: ModelConfig / TrainConfig fields to change.
        device: "cpu", "cuda", ...; None picks CUDA when available.

    Raises:
        ValueError / FileNotFoundError: bad settings or data (messages say what to change).
    """
    spec = get_preset(preset)
    if max_chars is None and (dataset is not None or (data is not None and Path(data).is_dir())):
        max_chars = 300_000
    text, source = load_text(data, max_chars, dataset)
    tokenizer = CharTokenizer.from_text(text)
    model_cfg = ModelConfig.from_dict({**spec.model, **(model_overrides or {}),
                                       "vocab_size": tokenizer.vocab_size})
    train_cfg = TrainConfig.from_dict({**spec.train, **(train_overrides or {})})
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    train_ids, val_ids = split_ids(ids, train_cfg.val_fraction)
    check_split("train", train_ids, model_cfg.block_size)
    check_split("validation", val_ids, model_cfg.block_size)

    out_dir = Path(out) if out is not None else _free_run_dir(preset)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a directory")
    if (out_dir / "model.safetensors").exists() and not overwrite:
        raise ValueError(f"{out_dir} already holds a trained model; pass --overwrite to replace "
                         f"it or choose another --out")
    # The run is built in <out>.partial and moved into place only when complete, so a failed
    # run neither leaves a half-written run under the run's name nor damages an earlier one.
    stage = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)

    torch.manual_seed(train_cfg.seed)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = DecoderLM(model_cfg).to(device)
    log(f"data: {source}: {len(text):,} characters, vocabulary {tokenizer.vocab_size}, "
        f"train {len(train_ids):,} / validation {len(val_ids):,} tokens")
    log(f"model: {model.num_parameters():,} parameters (n_layers {model_cfg.n_layers}, "
        f"d_model {model_cfg.d_model}, n_heads {model_cfg.n_heads}, block_size "
        f"{model_cfg.block_size}); preset {preset!r}, {train_cfg.max_steps} steps, "
        f"{train_cfg.dtype} on {device}")
    result = train(model, train_cfg, train_ids, val_ids, stage / "metrics.jsonl", progress)

    model.save_pretrained(stage, {"train": train_cfg.to_dict(), "preset": preset,
                                  "data": source, "data_spec": {
                                      "path": None if data is None else str(Path(data).resolve()),
                                      "dataset": dataset, "max_chars": max_chars,
                                      "token_dir": None, "val_fraction": train_cfg.val_fraction}})
    tokenizer.save_pretrained(stage)
    _write_artifacts(model, tokenizer, train_cfg, result, val_ids, stage)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in stage.iterdir():
        os.replace(path, out_dir / path.name)
    stage.rmdir()
    summary = RunSummary(out_dir, result.val_loss, result.val_loss / LN2, result.elapsed_s,
                         result.tokens_per_s, source)
    log(f"final validation loss {summary.val_loss:.4f} nats/char = {summary.val_bpc:.4f} "
        f"bits/char (whole validation split), {result.elapsed_s:.1f} s of training at "
        f"{result.tokens_per_s:,.0f} tokens/s")
    log(f"wrote {out_dir}/: model.safetensors config.json tokenizer.json metrics.jsonl "
        f"loss.png attention.png samples.txt")
    return summary


def _write_artifacts(model, tokenizer, cfg: TrainConfig, result: TrainResult,
                     val_ids: torch.Tensor, out_dir: Path) -> None:
    from .plots import plot_attention, plot_loss

    plot_loss(result.metrics, out_dir / "loss.png")
    window = val_ids[: min(64, model.config.block_size, len(val_ids))][None, :]
    model.eval()
    with torch.no_grad():
        _, att = model.forward_with_attention(window.to(model.lm_head.weight.device))
    shown = tokenizer.decode(window[0])
    plot_attention(att[:, 0].cpu().numpy(), out_dir / "attention.png",
                   title=f"attention on validation characters 0-{window.size(1) - 1}: "
                         f"{shown!r}")
    prompt = cfg.sample_prompt if all(c in tokenizer.stoi for c in cfg.sample_prompt) \
        else tokenizer.decode(val_ids[:1])
    idx = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long)
    out = model.generate(idx.to(model.lm_head.weight.device), cfg.sample_chars, seed=cfg.seed)
    (out_dir / "samples.txt").write_text(tokenizer.decode(out[0]), encoding="utf-8")
