"""The files a run writes after training, besides the model: the post-run step of
`run_experiment`.

`write_artifacts` reads the run directory's metrics.jsonl and writes loss.png, attention.png
(every layer and head on the first 64 validation tokens), report.html / report.json (the lens
report on the first 128 validation tokens) and samples.txt (`ArtifactsConfig.sample_chars`
tokens from `ArtifactsConfig.sample_prompt`). Training never reads these settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..config import ArtifactsConfig
from ..data.corpus import token_stream
from ..generation.generate import generate
from ..lens.plots import Plotter
from ..lens.report import build_report, write_report
from ..model.hooks import run_with_cache
from ..model.model import DecoderLM

__all__ = ["write_artifacts", "attention_maps"]


def write_artifacts(
    model: DecoderLM,
    tokenizer,
    settings: ArtifactsConfig,
    val_ids,
    out_dir: Path,
    seed: int,
    plotter: Plotter,
    log=print,
) -> None:
    """Write loss.png, attention.png, report.html / report.json and samples.txt into out_dir.

    The plots are drawn by `plotter`'s process (started early: it imports matplotlib while
    the run trains) while the report and the sample are made here, on one thread fewer.

    Args:
        model: the trained DecoderLM (any device).
        tokenizer: the run's tokenizer.
        settings: the sample's length and prompt.
        val_ids: [N] validation token ids (a tensor or a numpy / memmapped array).
        out_dir: the run directory, holding the run's metrics.jsonl.
        seed: seeds the sample's draws.
        plotter: the `decoderlm.lens.plots.Plotter` that draws the two plots.
        log: print function for notes (a prompt outside the vocabulary).

    Raises:
        OSError: a file could not be read or written.
    """
    val_ids = token_stream(val_ids)
    metrics = [
        json.loads(line)
        for line in (out_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    n = min(64, model.config.block_size, len(val_ids))
    window = torch.tensor(np.asarray(val_ids[:n], dtype=np.int64))[None, :]
    plotter.draw(
        metrics,
        out_dir / "loss.png",
        attention_maps(model, window).numpy(),
        out_dir / "attention.png",
        title=f"attention on validation tokens 0-{n - 1}: {tokenizer.decode(window[0])!r}",
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1))  # a core for the plots: no waits at barriers
    try:
        _write_report(model, tokenizer, val_ids, out_dir)
        _write_sample(model, tokenizer, settings, window[0, 0].item(), out_dir, seed, log)
    finally:
        torch.set_num_threads(threads)
        plotter.wait()


@torch.no_grad()
def attention_maps(model: DecoderLM, idx: torch.Tensor) -> torch.Tensor:
    """Every layer's attention probabilities for idx [1, T] in eval mode: [n_layers, n_heads,
    T, T] float32 on the CPU."""
    model.eval()
    _, cache = run_with_cache(model, idx.to(model.device), ["hook_pattern"])
    return torch.stack(list(cache.values()))[:, 0].cpu()  # hook order is layer order


def _write_report(model: DecoderLM, tokenizer, val_ids, out_dir: Path) -> None:
    """report.html / report.json of the final model on the first 128 validation tokens."""
    n = min(128, model.config.max_positions, len(val_ids))
    ids = [int(i) for i in np.asarray(val_ids[:n])]
    title = f"{out_dir.name}: the first {n} validation tokens"
    write_report(build_report(model, tokenizer, ids, title=title), out_dir / "report.html")


def _write_sample(
    model: DecoderLM,
    tokenizer,
    settings: ArtifactsConfig,
    first_val_id: int,
    out_dir: Path,
    seed: int,
    log,
) -> None:
    """samples.txt: settings.sample_chars tokens sampled from settings.sample_prompt (from the
    first validation token when the prompt has characters outside the vocabulary)."""
    try:
        prompt = tokenizer.encode(settings.sample_prompt, allowed_special="all")
    except ValueError:  # the prompt has characters outside a character vocabulary
        prompt = []
        log(
            f"note: sample_prompt {settings.sample_prompt!r} has characters outside the "
            f"vocabulary; samples.txt starts from the first validation token instead"
        )
    idx = torch.tensor([prompt or [first_val_id]], dtype=torch.long)
    # past a full context the window slides by half of it at a time: one forward pass over
    # the window per max_positions // 2 new tokens instead of one per token
    slide_by = max(1, model.config.max_positions // 2)
    out = generate(model, idx.to(model.device), settings.sample_chars, seed=seed, slide_by=slide_by)
    (out_dir / "samples.txt").write_text(tokenizer.decode(out[0]), encoding="utf-8")
