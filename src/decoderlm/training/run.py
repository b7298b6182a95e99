"""A whole training run (`decoderlm train`): request -> plan -> model -> train -> artifacts.

`run_experiment` makes the request (`plan.RunRequest`) from its arguments and the plan from
it (`plan.make_plan`: a new run, a fine-tune or a resumed one), checks and prepares the run
directory (`run_dir`), builds the model, calls `loop.train`, then writes the run's files:
model.safetensors, config.json, tokenizer.json (Hugging Face's format) and
decoderlm_tokenizer.json, then the post-run step `artifacts.write_artifacts` (loss.png,
attention.png, samples.txt, report.html / report.json; metrics.jsonl and checkpoints/ are
written while training).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch

from ..allocator import keep_freed_memory
from ..arguments import Fields, NonNegativeInt, NotEmptyPath, PositiveInt
from ..config import ModelConfig, TrainConfig
from ..data.conversations import Conversations
from ..errors import UserError, checked_device
from ..evaluate import LN2
from ..finetune.merge import merge_run
from ..finetune.trainable import lora_entry, prepare_trainable, trainable_counts
from ..io.targets import export_summary
from ..lens.plots import Plotter
from ..model.analysis import out_of_memory_as_user_error
from ..model.model import DecoderLM
from ..model.weights import ADAPTER_NAME
from ..presets import PresetName
from ..tokenizers import CharTokenizer
from .artifacts import write_artifacts
from .launch import resume_command
from .loop import TrainResult, autocast_for, resolve_dtype, train
from .metrics import bytes_per_token
from .parallel import DistInfo, barrier, init_distributed
from .plan import RunPlan, RunRequest, check_plan, checkpoint_model, make_plan
from .run_dir import prepare_run_dir, run_files, save_run
from .run_options import resumed_run_options, run_options, stored_run_options
from .threads import ThreadTuner, busy_machine_hint, parse_threads, set_threads

__all__ = ["run_experiment", "RunSummary"]


@dataclass(frozen=True)
class RunSummary:
    """What `run_experiment` returns; val_loss and val_bpc are None for an interrupted run.

    Attributes:
        out_dir: the run directory.
        val_loss: the final validation loss over the whole validation split (nats/token).
        val_bpc: val_loss / ln 2 (bits/token).
        elapsed_s: seconds of training (over every run that led to this one).
        tokens_per_s: training tokens per second, all processes together.
        data_source: the corpus in words (config.json["data"]).
        step: optimizer steps done.
        interrupted: the run stopped early (Ctrl-C, SIGTERM) after a checkpoint.
    """

    out_dir: Path
    val_loss: float | None
    val_bpc: float | None
    elapsed_s: float
    tokens_per_s: float
    data_source: str
    step: int = 0
    interrupted: bool = False


def run_experiment(
    preset: PresetName | None = None,
    data: NotEmptyPath | None = None,
    dataset: str | None = None,
    max_chars: NonNegativeInt | None = None,
    out: NotEmptyPath | None = None,
    overwrite: bool = False,
    resume: NotEmptyPath | None = None,
    init_from: NotEmptyPath | None = None,
    merge: bool | None = None,
    base: NotEmptyPath | None = None,
    no_verify: bool = False,
    device: str | None = None,
    no_progress: bool = False,
    nproc_per_node: PositiveInt | None = None,
    threads: int | str | None = None,
    model_overrides: Annotated[dict[str, Any] | None, Fields(ModelConfig, "model")] = None,
    train_overrides: Annotated[dict[str, Any] | None, Fields(TrainConfig, "train")] = None,
    *,
    log=print,
) -> RunSummary:
    """Train a GPT-style model.

    With no arguments: the 'default' preset, a character model of the embedded WikiText-2
    crop. Settings come from the preset, then the settings file (--config FILE), then the
    flags below (each ModelConfig / TrainConfig field). The run directory gets metrics.jsonl
    and checkpoints/ while training, then model.safetensors, config.json, the tokenizer
    files, loss.png, attention.png, samples.txt and report.html / report.json (the lens
    report). Under torchrun every process runs this; rank 0 writes the files.

    Args:
        preset: named settings (default: 'default'; with --init-from, 'finetune').
        data: a UTF-8 text file, a directory with wiki.train.raw or train.txt (its train
            split), or a directory made by `decoderlm prepare` (default: the embedded first
            300,000 characters of WikiText-2 raw, validation split).
        dataset: e.g. wikitext-2-raw-v1 through the optional `datasets` package (needs the
            network).
        max_chars: use only the first N characters (0: all; default 300,000 for a WikiText
            directory or dataset, all of a plain file).
        out: run directory (default: runs/<preset>, or runs/<preset>-2, ... if taken).
        overwrite: replace a run already in --out (its files, and only those, are deleted
            after every check, just before training).
        resume: continue the run in DIR from its newest checkpoint (settings such as
            --max-steps may change; the model and data may not); metrics.jsonl is appended
            to. The run's --device, --threads and --merge are repeated (one line says so; a
            flag given overrides, with a warning when it changes the device or the threads).
        init_from: fine-tune: start from the weights of a decoderlm run directory or a
            Hugging Face GPT-2 directory (config.json + model.safetensors or
            pytorch_model.bin); the model's shape and tokenizer come from it (only --dropout
            may change, and --block-size N may crop its context to N positions), the data
            are encoded with its tokenizer, the optimizer and schedule start fresh, and the
            preset defaults to 'finetune' (lr 3e-4, 20 warm-up steps, 300 steps; see
            `decoderlm presets`; a preset's model settings do not apply).
            With --lora-rank R the run trains LoRA adapters alone and saves them alone
            (adapter.safetensors). config.json records the source in "init_from".
        merge: after training with LoRA adapters, also write the merged model to
            <out>/merged/ (an ordinary model directory). Default: false; resuming, the run's.
        base: the base model of the LoRA run given to --resume (or to --init-from) in a new
            place; config.json records it as found (default: where the run records it,
            relative to the run first, then the absolute path).
        no_verify: load --init-from's weights and --resume's checkpoints without checking
            them against the sizes and sha256 digests that their config.json records (for
            huge files); --resume then also tries the checkpoints an earlier resume set aside
            as damaged-step-N.
        device: cpu, cuda, ... (default: cuda if available; resuming, the run's).
        no_progress: print neither the progress bar nor the evaluation lines (metrics.jsonl
            still has them).
        nproc_per_node: train with N processes on this machine, started through torchrun
            (--standalone; DDP, or FSDP with --fsdp); Ctrl-C stops them all after a
            checkpoint, as it stops one process. Under a torchrun of your own, leave it out.
            The `decoderlm` command starts the processes; a Python caller runs under
            torchrun instead.
        threads: CPU threads: N (at most the machine's CPUs), or auto (time a few training
            steps at 1, 2, ... threads on this machine as it is loaded now and keep the
            fastest; while training, re-time them when steps slow down or every 300 steps
            and move to the fastest); default torch's (the usable cores); resuming, the
            run's.
            OMP_WAIT_POLICY=PASSIVE in the environment makes idle threads sleep instead of
            spinning.
        model_overrides: ModelConfig fields to change (`model` in a settings file).
            Default: the preset's.
        train_overrides: TrainConfig fields to change (`train` in a settings file).
            Default: the preset's where it sets one, else the one shown.
        log: prints the run's lines (rank 0 only).

    Returns:
        A RunSummary (val_loss and val_bpc None for an interrupted run).

    Raises:
        UserError / MissingFileError: bad settings, data or checkpoints (messages say what
            to change); not enough memory to build or train the model (one line with the
            estimate of `memory_bytes`).
    """
    given, notes = {"device": device, "threads": threads, "merge": merge}, []
    if resume is not None:  # the run's settings, for those not given
        given, notes = resumed_run_options(stored_run_options(resume, no_verify), given)
    device, threads, merge = given["device"], given["threads"], bool(given["merge"])
    request = RunRequest(
        preset=preset,
        data=data,
        dataset=dataset,
        max_chars=max_chars,
        out=out,
        overwrite=overwrite,
        resume=resume,
        init_from=init_from,
        merge=merge,
        base=base,
        verify=not no_verify,
        model_overrides=model_overrides,
        train_overrides=train_overrides,
    )
    if nproc_per_node is not None and "LOCAL_RANK" not in os.environ:
        raise UserError(
            f"nproc_per_node={nproc_per_node} starts processes from the command line "
            f"(`decoderlm train --nproc-per-node {nproc_per_node}`); run under torchrun instead"
        )
    device, threads = checked_device(device), parse_threads(threads)
    info, device = init_distributed(device)
    log = info.main_only(log)
    plan = make_plan(request, info, log)
    plan = dataclasses.replace(plan, train_cfg=resolve_dtype(plan.train_cfg, device))
    check_plan(plan, info, request.overwrite)  # on every rank: all fail alike
    for note in notes if info.is_main else ():
        print(note, file=sys.stderr)
    memory = dict(config=plan.model_cfg, batch_size=plan.train_cfg.data.batch_size)
    with out_of_memory_as_user_error("build the model", **memory):
        model, lora = _build_model(plan, info, device)  # refuses LoRA targets / --freeze items too
    plan = dataclasses.replace(plan, start_model=None, lora=lora)  # the model holds the weights
    if info.is_main:
        prepare_run_dir(plan.out_dir, plan.resumed_step, log)
    barrier(info)
    if device.type == "cpu":
        keep_freed_memory()  # each step reuses the last one's activations (no page faults)
    tuner = _set_threads(threads, model, plan, device, log)
    options = run_options(device, info.world_size, threads, request.merge)
    plan = dataclasses.replace(plan, run_options=options)
    _log_start(plan, model, info, device, log)
    # the plots' process imports matplotlib now, on a core left idle while torch starts up
    plotter = Plotter() if info.is_main else None
    try:
        with out_of_memory_as_user_error("train the model", **memory):
            result = train(
                model,
                plan.train_cfg,
                plan.train_ids,
                plan.val_ids,
                run_dir=plan.out_dir,
                progress=not no_progress,
                info=info,
                resume=plan.resume_state,
                checkpoint_files={"extra": plan.extra, "tokenizer": plan.tokenizer},
                log=log,
                val_bytes_per_token=bytes_per_token(plan.tokenizer, plan.val_ids),
                on_step=tuner.step_done if tuner else None,
            )
        if info.is_main and not result.interrupted:
            _save(model, result, plan, info, device, plotter, log)
            if request.merge:
                log(f"merged model: {merge_run(plan.out_dir, plan.out_dir / 'merged')}")
    finally:
        if plotter is not None:
            plotter.close()
    return _summarize(plan, result, log)


def _build_model(
    plan: RunPlan, info: DistInfo, device: torch.device
) -> tuple[DecoderLM, dict | None]:
    """(the model to train on `device`, its config.json["lora"] entry or None): new (seeded
    with the training seed), the checkpoint's, or a copy of --init-from's with the plan's
    config. Every rank starts from the same weights and then draws its own dropout."""
    torch.manual_seed(plan.train_cfg.data.seed)
    if plan.checkpoint is not None:
        model = plan.start_model
    else:
        model = DecoderLM(plan.model_cfg)
        if plan.start_model is not None:
            model.load_state_dict(plan.start_model.state_dict())
    prepare_trainable(model, plan.train_cfg.finetune)
    lora = lora_entry(model, plan.train_cfg.finetune)
    model = model.to(device)
    if info.world_size > 1:
        torch.manual_seed(plan.train_cfg.data.seed + info.rank)
    return model, lora


def _set_threads(threads, model: DecoderLM, plan: RunPlan, device, log) -> ThreadTuner | None:
    """Set torch's CPU threads (`threads.set_threads`); the ThreadTuner that re-times them
    while training for --threads auto on the CPU, else None. On the default, says so when a
    busy machine will make training crawl."""
    autocast = autocast_for(plan.train_cfg, device)
    set_threads(threads, model, plan.train_cfg, plan.train_ids, autocast, log)
    tuner = ThreadTuner(log) if threads == "auto" and model.device.type == "cpu" else None
    if threads is None and model.device.type == "cpu":
        hint = busy_machine_hint(torch.get_num_threads())
        if hint:
            log(hint)
    return tuner


def _size(data) -> str:
    """A split's size in words: its tokens, and its conversations when it has them."""
    if isinstance(data, Conversations):
        plural = "s" if data.count != 1 else ""
        return f"{data.count:,} conversation{plural} ({len(data):,} tokens)"
    return f"{len(data):,} tokens"


def _log_start(plan: RunPlan, model: DecoderLM, info: DistInfo, device: torch.device, log) -> None:
    cfg, train_cfg = plan.model_cfg, plan.train_cfg
    log(
        f"data: {plan.corpus}, vocabulary {plan.tokenizer.vocab_size}, train "
        f"{_size(plan.train_ids)} / validation {_size(plan.val_ids)}"
    )
    log(
        f"model: {model.num_parameters():,} parameters (n_layers {cfg.n_layers}, "
        f"d_model {cfg.d_model}, n_heads {cfg.n_heads}, block_size "
        f"{cfg.block_size}"
        + (f", vocabulary padded to {cfg.padded_vocab_size} rows" if cfg.padded_vocab_size else "")
        + f"); preset {plan.preset!r}, {train_cfg.steps.max_steps} steps, "
        f"{train_cfg.compute.dtype} on {device}"
        + (f" x {info.world_size} processes" if info.world_size > 1 else "")
        + (f"; resuming from {plan.checkpoint}" if plan.checkpoint else "")
    )
    counts = trainable_counts(model)
    if counts["trainable"] != counts["total"]:
        lora = plan.lora
        log(
            f"trainable: {counts['trainable']:,} of {counts['total']:,} parameters"
            + (
                f" (LoRA r={lora['rank']}, alpha {lora['alpha']:g} on {len(lora['modules'])}"
                f" layers)"
                if lora
                else ""
            )
            + (f"; frozen: {train_cfg.finetune.freeze}" if train_cfg.finetune.freeze else "")
        )


def _save(
    model: DecoderLM, result: TrainResult, plan: RunPlan, info: DistInfo, device, plotter, log
):
    """Write the trained model, its tokenizer and the artifacts into the run directory (rank
    0). Under torchrun the full weights are read back from the last checkpoint."""
    final = (
        checkpoint_model(result.checkpoint, map_location=str(device))
        if info.world_size > 1
        else model
    )
    save_run(final, plan.tokenizer, plan.out_dir, plan.extra)
    write_artifacts(
        final,
        plan.tokenizer,
        settings=plan.train_cfg.artifacts,
        val_ids=plan.val_ids,
        out_dir=plan.out_dir,
        seed=plan.train_cfg.data.seed,
        plotter=plotter,
        log=log,
    )


def _summarize(plan: RunPlan, result: TrainResult, log) -> RunSummary:
    """The RunSummary, and the closing lines (how to resume, or the final loss and files)."""
    if result.interrupted:
        log(f"resume with: {resume_command(plan.out_dir)}")
        return RunSummary(
            out_dir=plan.out_dir,
            val_loss=None,
            val_bpc=None,
            elapsed_s=result.elapsed_s,
            tokens_per_s=result.tokens_per_s,
            data_source=plan.corpus,
            step=result.step,
            interrupted=True,
        )
    summary = RunSummary(
        out_dir=plan.out_dir,
        val_loss=result.val_loss,
        val_bpc=result.val_loss / LN2,
        elapsed_s=result.elapsed_s,
        tokens_per_s=result.tokens_per_s,
        data_source=plan.corpus,
        step=result.step,
    )
    unit = "char" if isinstance(plan.tokenizer, CharTokenizer) else "token"
    log(
        f"final validation loss {summary.val_loss:.4f} nats/{unit} = {summary.val_bpc:.4f} "
        f"bits/{unit} (whole validation split), {result.elapsed_s:.1f} s of training at "
        f"{result.tokens_per_s:,.0f} tokens/s"
    )
    written = run_files(plan.out_dir)
    if plan.lora:
        written = [
            f"{n} (LoRA adapters over {plan.init_from['path']})" if n == ADAPTER_NAME else n
            for n in written
        ]
    log(f"wrote {plan.out_dir}/: {' '.join(written)}")
    log(export_summary(plan.model_cfg, plan.out_dir, adapters=bool(plan.lora)))
    return summary
