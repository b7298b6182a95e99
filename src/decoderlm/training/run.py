"""A whole training run (`decoderlm train`): settings -> corpus -> model -> train -> artifacts.

`run_experiment` decides what to train (a new run from a preset and overrides, or a resumed
one from its newest checkpoint), checks and prepares the run directory, builds the model,
calls `loop.train`, then writes the run's files: model.safetensors, config.json,
tokenizer.json (Hugging Face's format) and decoderlm_tokenizer.json, then the post-run step
`artifacts.write_artifacts` (loss.png, attention.png, samples.txt, report.html / report.json;
metrics.jsonl and checkpoints/ are written while training).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch

from ..arguments import Fields, NonNegativeInt, NotEmptyPath, PositiveInt
from ..config import FinetuneConfig, ModelConfig, TrainConfig
from ..data.corpus import check_split, data_spec, load_corpus
from ..errors import UserError, checked_device
from ..evaluate import LN2
from ..files import atomic_write, read_json
from ..finetune.init_from import finetune_config
from ..finetune.merge import merge_run
from ..finetune.trainable import lora_entry, prepare_trainable, trainable_counts
from ..io.load import load_model, load_source, load_tokenizer
from ..io.targets import export_summary
from ..lens.plots import Plotter
from ..model.analysis import out_of_memory_as_user_error
from ..model.model import DecoderLM
from ..model.weights import ADAPTER_NAME, list_checkpoints
from ..presets import PresetName, get_preset
from ..tokenizers import CharTokenizer, Tokenizer
from .artifacts import write_artifacts
from .checkpoints import latest_checkpoint, load_trainer_state
from .launch import resume_command
from .loop import TrainResult, autocast_for, train
from .metrics import bytes_per_token, check_sinks
from .parallel import DistInfo, barrier, init_distributed
from .threads import ThreadTuner, busy_machine_hint, parse_threads, set_threads

__all__ = ["run_experiment", "RunSummary"]

_RUN_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "decoderlm_tokenizer.json",
    "metrics.jsonl",
    "metrics.csv",
    "tensorboard",
    "loss.png",
    "attention.png",
    "samples.txt",
    "report.html",
    "report.json",
    "checkpoints",
    "adapter.safetensors",
    "merged",
)
_FINETUNE_FIELDS = tuple(f.name for f in dataclasses.fields(FinetuneConfig))


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


@dataclass
class RunPlan:
    """What a run trains, on what and where, decided before any file is touched."""

    out_dir: Path
    preset: str
    spec: dict  # config.json["data_spec"], see `decoderlm.data.corpus.data_spec`
    model_cfg: ModelConfig
    train_cfg: TrainConfig
    tokenizer: Tokenizer
    train_ids: object
    val_ids: object
    source: str
    checkpoint: Path | None = None  # resuming: the checkpoint, its trainer state and model
    resume_state: dict | None = None
    resumed: DecoderLM | None = None
    init_from: dict | None = None  # fine-tuning: config.json["init_from"], the source's model
    base: DecoderLM | None = None
    lora: dict | None = None  # config.json["lora"] once adapters are added

    @property
    def resumed_step(self) -> int | None:
        """The checkpoint's step when resuming, else None."""
        return None if self.resume_state is None else self.resume_state["step"]

    @property
    def extra(self) -> dict:
        """The config.json entries besides the model config."""
        extra = {
            "train": self.train_cfg.to_dict(),
            "preset": self.preset,
            "data": self.source,
            "data_spec": self.spec,
        }
        extra.update({k: v for k, v in (("init_from", self.init_from), ("lora", self.lora)) if v})
        return extra


def run_experiment(
    preset: PresetName | None = None,
    data: NotEmptyPath | None = None,
    dataset: str | None = None,
    max_chars: NonNegativeInt | None = None,
    out: NotEmptyPath | None = None,
    overwrite: bool = False,
    resume: NotEmptyPath | None = None,
    init_from: NotEmptyPath | None = None,
    merge: bool = False,
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
            to.
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
            <out>/merged/ (an ordinary model directory).
        no_verify: load --init-from's weights and --resume's checkpoints without checking
            them against the sizes and sha256 digests that their config.json records (for
            huge files).
        device: cpu, cuda, ... (default: cuda if available).
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
            and move to the fastest); default torch's (the usable cores).
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
    _check_arguments(model_overrides, train_overrides, resume, overwrite, nproc_per_node)
    device, progress, threads = checked_device(device), not no_progress, parse_threads(threads)
    model_overrides, train_overrides = dict(model_overrides or {}), dict(train_overrides or {})
    info, device = init_distributed(device)
    log = info.main_only(log)
    request = dict(preset=preset, data=data, out=out, dataset=dataset, max_chars=max_chars)
    request["verify"] = not no_verify
    request.update(model_overrides=model_overrides, train_overrides=train_overrides)
    plan = _make_plan(request, resume, init_from, merge, info, log)
    _check_plan(plan, info, overwrite)  # on every rank: all fail alike
    memory = dict(config=plan.model_cfg, batch_size=plan.train_cfg.data.batch_size)
    with out_of_memory_as_user_error("build the model", **memory):
        model = _build_model(plan, info, device)  # refuses LoRA targets / --freeze items too
    if info.is_main:
        _prepare_run_dir(plan.out_dir, plan.resumed_step, log)
    barrier(info)
    set_threads(
        threads, model, plan.train_cfg, plan.train_ids, autocast_for(plan.train_cfg, device), log
    )
    tuner = ThreadTuner(log) if threads == "auto" and model.device.type == "cpu" else None
    if threads is None and model.device.type == "cpu":  # the default: say when it will crawl
        hint = busy_machine_hint(torch.get_num_threads())
        if hint:
            log(hint)
    _log_start(plan, model, info, device, log)
    files = {"extra": plan.extra, "tokenizer": plan.tokenizer}
    # the plots' process imports matplotlib now, on a core left idle while torch starts up
    plotter = Plotter() if info.is_main else None
    try:
        with out_of_memory_as_user_error("train the model", **memory):
            result = train(
                model,
                plan.train_cfg,
                plan.train_ids,
                plan.val_ids,
                plan.out_dir,
                progress,
                info,
                resume=plan.resume_state,
                checkpoint_files=files,
                log=log,
                val_bytes_per_token=bytes_per_token(plan.tokenizer, plan.val_ids),
                on_step=tuner.step_done if tuner else None,
            )
        if info.is_main and not result.interrupted:
            final = _save_run(model, result, plan, info, device)
            write_artifacts(
                final,
                plan.tokenizer,
                plan.train_cfg.artifacts,
                plan.val_ids,
                plan.out_dir,
                plan.train_cfg.data.seed,
                plotter,
                log,
            )
            if merge:
                log(f"merged model: {merge_run(plan.out_dir, plan.out_dir / 'merged')}")
    finally:
        if plotter is not None:
            plotter.close()
    return _summarize(plan, result, log)


def _check_arguments(model_overrides, train_overrides, resume, overwrite, nproc_per_node):
    """UserError for arguments of `run_experiment` that cannot go together or are not dicts."""
    for name, fields in (("model", model_overrides), ("train", train_overrides)):
        if not isinstance(fields, dict | None):
            raise UserError(f"{name}_overrides must map fields to values, got {fields!r}")
    if resume and overwrite:
        raise UserError("--resume continues a run and --overwrite replaces one; pick one")
    if nproc_per_node is not None and "LOCAL_RANK" not in os.environ:
        raise UserError(
            f"nproc_per_node={nproc_per_node} starts processes from the command line "
            f"(`decoderlm train --nproc-per-node {nproc_per_node}`); run under torchrun instead"
        )


def _make_plan(request: dict, resume, init_from, merge: bool, info: DistInfo, log) -> RunPlan:
    """The plan of a resumed run (`_resume_plan`) or a new one (`_new_plan`)."""
    request["train_overrides"] = TrainConfig.flatten(request["train_overrides"])
    if resume is not None and init_from is not None:
        raise UserError(
            "--resume continues a run, which already records where it started; drop --init-from"
        )
    if resume is not None:
        plan = _resume_plan(Path(resume), info, log, **request)
    else:
        plan = _new_plan(**request, init_from=init_from, log=log)
    if merge and plan.train_cfg.finetune.lora_rank is None:
        raise UserError("--merge merges LoRA adapters; this run has none (give --lora-rank R)")
    return plan


def _new_plan(
    *,
    preset,
    data,
    out,
    dataset,
    max_chars,
    model_overrides: dict,
    train_overrides: dict,
    init_from=None,
    log=print,
    verify: bool = True,
) -> RunPlan:
    """A new run: the preset's settings plus the overrides, on a freshly read corpus."""
    preset = preset or ("finetune" if init_from is not None else "default")
    preset_spec = get_preset(preset)
    settings = {**preset_spec.train, **train_overrides}
    if init_from is None and (settings.get("lora_rank") is not None or not preset_spec.model):
        raise UserError(
            "LoRA adapters and the 'finetune' preset adapt an existing model; give "
            "--init-from SRC (a run directory or a Hugging Face GPT-2 directory)"
        )
    train_cfg = TrainConfig.from_dict(settings)
    lora_only = [k for k in ("lora_alpha", "lora_targets", "lora_dropout") if k in train_overrides]
    if lora_only and train_cfg.finetune.lora_rank is None:
        flags = ", ".join("--" + k.replace("_", "-") for k in lora_only)
        raise UserError(
            f"{flags} set LoRA adapters, which this run has none of; give --lora-rank R"
        )
    spec = data_spec(data, dataset, max_chars, train_cfg.data.val_fraction)
    if spec["token_dir"] and (max_chars or "val_fraction" in train_overrides):
        raise UserError(
            "--max-chars and --val-fraction do not apply to a prepared token "
            "directory: its split was fixed by `decoderlm prepare` (run it "
            "again with --val-fraction)"
        )
    if init_from is not None:
        plan_args = (preset, spec, out, model_overrides, train_cfg, log, verify)
        return _finetune_plan(init_from, *plan_args)
    tokenizer, train_ids, val_ids, source, fingerprint = load_corpus(spec)
    spec["fingerprint"] = fingerprint
    model_cfg = ModelConfig.from_dict(
        {**preset_spec.model, **_vocab_settings(model_overrides, tokenizer.vocab_size)}
    )
    out_dir = Path(out) if out is not None else _free_run_dir(preset)
    return RunPlan(
        out_dir, preset, spec, model_cfg, train_cfg, tokenizer, train_ids, val_ids, source
    )


def _vocab_settings(model_overrides: dict, n_tokens: int) -> dict:
    """model_overrides with vocab_size the tokenizer's n_tokens. A vocab_size asked for that is
    larger becomes padded_vocab_size (rows never produced); a smaller one is a ValueError."""
    settings = {**model_overrides, "vocab_size": n_tokens}
    asked = model_overrides.get("vocab_size")
    if asked is None or asked == n_tokens:
        return settings
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < n_tokens:
        raise UserError(
            f"vocab_size {asked!r} is smaller than the tokenizer's {n_tokens} tokens; "
            f"drop --vocab-size (it defaults to the tokenizer's) or give at least {n_tokens}"
        )
    if model_overrides.get("padded_vocab_size") not in (None, asked):
        raise UserError(
            f"vocab_size {asked} (padding the tokenizer's {n_tokens} tokens) and "
            f"padded_vocab_size {model_overrides['padded_vocab_size']} disagree; give one"
        )
    return {**settings, "padded_vocab_size": asked}


def _finetune_plan(
    init_from,
    preset: str,
    spec: dict,
    out,
    model_overrides: dict,
    train_cfg: TrainConfig,
    log,
    verify: bool = True,
) -> RunPlan:
    """A new run from the weights of `init_from`: its shape (dropout may change) and
    tokenizer, the corpus encoded with that tokenizer (characters outside a char vocabulary
    mapped to its unknown token, and counted)."""
    source = load_source(init_from, verify=verify)
    context = model_overrides.get("block_size")
    if context is not None and context != source.model.config.block_size:
        source.model.crop_block_size(context)  # a fine-tune may shorten the context, not grow it
    model_cfg = finetune_config(source.model.config, model_overrides)
    spec["unknown"] = "unk"
    tokenizer, train_ids, val_ids, description, fingerprint = load_corpus(spec, source.tokenizer)
    if tokenizer.to_dict() != source.tokenizer.to_dict():
        raise UserError(
            f"{spec['token_dir']} was prepared with another tokenizer ({tokenizer!r}) than "
            f"{init_from}'s ({source.tokenizer!r}); pass the text file to encode it with the "
            f"model's tokenizer"
        )
    spec["fingerprint"] = fingerprint
    log(f"fine-tuning from {source.info['path']} ({source.info['kind']} weights)")
    out_dir = Path(out) if out is not None else _free_run_dir(preset)
    if out_dir.resolve() == Path(source.info["path"]):
        raise UserError(f"--out {out} is the --init-from directory; choose another --out")
    plan = RunPlan(
        out_dir, preset, spec, model_cfg, train_cfg, tokenizer, train_ids, val_ids, description
    )
    plan.init_from, plan.base = source.info, source.model
    return plan


def _resume_plan(
    out_dir: Path,
    info: DistInfo,
    log,
    *,
    out,
    preset,
    data,
    dataset,
    max_chars,
    model_overrides: dict,
    train_overrides: dict,
    verify: bool = True,
) -> RunPlan:
    """A resumed run: the checkpoint's settings (training ones may be overridden) and data,
    each override that contradicts them refused."""
    if out is not None and Path(out).resolve() != out_dir.resolve():
        raise UserError(
            f"--resume continues the run in {out_dir} itself; drop --out "
            f"{out} (copy the run directory first to branch it)"
        )
    checkpoint, resume_state, resumed, tokenizer = _resume_point(out_dir, info, log, verify)
    saved = read_json(checkpoint / "config.json")
    if preset is not None and preset != saved.get("preset"):
        raise UserError(
            f"the checkpoint was trained with preset {saved.get('preset')!r}, "
            f"not {preset!r}; drop --preset to resume"
        )
    given = {"dataset": dataset, "max_chars": max_chars}
    given["val_fraction"] = train_overrides.get("val_fraction")
    spec = _resumed_data_spec(saved, checkpoint / "config.json", data, given)
    _check_same("model config", saved["model"], model_overrides)
    finetuning = {k: v for k, v in train_overrides.items() if k in _FINETUNE_FIELDS}
    _check_same("fine-tuning settings", saved["train"], finetuning)
    model_cfg = ModelConfig.from_dict(saved["model"])
    train_cfg = TrainConfig.from_stored({**saved["train"], **train_overrides})
    tokenizer, train_ids, val_ids, source, fingerprint = load_corpus(spec, tokenizer)
    if spec.get("fingerprint") not in (None, fingerprint):
        raise UserError(
            f"the corpus at {spec['token_dir'] or spec['path']} is not the one "
            f"the checkpoint was trained on (its sha256 differs); restore it, "
            f"pass --data with the original, or start a new run"
        )
    _note_schedule_change(saved["train"], train_cfg, log)
    plan = RunPlan(
        out_dir,
        saved.get("preset"),
        spec,
        model_cfg,
        train_cfg,
        tokenizer,
        train_ids,
        val_ids,
        source,
        checkpoint,
        resume_state,
        resumed,
    )
    plan.init_from = saved.get("init_from")
    return plan


def _resumed_data_spec(saved: dict, config_path: Path, data, given: dict) -> dict:
    """The checkpoint's data_spec, with the data path moved to `data` when given (the corpus
    is then checked by its fingerprint); ValueError if a given data setting contradicts it."""
    spec = saved.get("data_spec")
    if not isinstance(spec, dict):
        raise UserError(f"{config_path} has no data_spec entry")
    _check_same("data", spec, {k: v for k, v in given.items() if v is not None})
    if data is not None:
        moved = str(Path(data).resolve())
        spec = {**spec, "path": moved, "token_dir": moved if spec.get("token_dir") else None}
    return spec


def _note_schedule_change(saved_train: dict, train_cfg: TrainConfig, log) -> None:
    """Say so when a resumed cosine or wsd schedule now decays over another number of steps."""
    old_decay = saved_train.get("decay_steps") or saved_train["max_steps"]
    steps = train_cfg.steps
    new_decay = steps.decay_steps or steps.max_steps
    if steps.schedule in ("cosine", "wsd") and new_decay != old_decay:
        log(
            f"note: the {steps.schedule} schedule now decays over {new_decay} steps instead of "
            f"{old_decay}; pass --decay-steps {old_decay} to keep the original schedule"
        )


def _check_same(kind: str, saved: dict, overrides: dict) -> None:
    """Raise ValueError naming each command-line value that contradicts the checkpoint."""
    clashes = [
        f"{k} is {saved.get(k)!r} in the checkpoint but {v!r} here"
        for k, v in overrides.items()
        if saved.get(k) != v
    ]
    if clashes:
        raise UserError(
            f"the checkpoint's {kind} does not match the command line: "
            f"{'; '.join(clashes)}; drop those options to resume, or start a new "
            f"run with --out"
        )


def _resume_point(run_dir: Path, info: DistInfo, log, verify: bool = True):
    """(checkpoint, its trainer state, model and tokenizer) for the newest checkpoint of
    run_dir that loads whole. A damaged newer one is skipped with a warning and renamed
    damaged-step-N (by rank 0), so it stays on disk for inspection but out of the
    keep_checkpoints rotation."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--resume {run_dir} is a file; give the run directory")
    latest_checkpoint(run_dir)  # raises a clear error when there is none
    for candidate in reversed(list_checkpoints(run_dir)):
        try:
            return (
                candidate,
                load_trainer_state(candidate, verify),
                load_model(candidate, merge=False, verify=verify),
                load_tokenizer(candidate),
            )
        except (ValueError, FileNotFoundError) as e:
            aside = candidate.with_name("damaged-" + candidate.name)
            log(
                f"warning: skipping checkpoint {candidate}: {e}; moved it to {aside} (delete "
                "it once you no longer need it) and trying the checkpoint before it"
            )
            if info.is_main:
                os.replace(candidate, aside)
    raise UserError(
        f"no checkpoint in {run_dir / 'checkpoints'} can be loaded; see the warnings above"
    )


def _free_run_dir(name: str, root: Path = Path("runs")) -> Path:
    """runs/<name>, or runs/<name>-2, -3, ... if it is taken: never overwrite a run."""
    candidate, n = root / name, 1
    while candidate.exists():
        n += 1
        candidate = root / f"{name}-{n}"
    return candidate


def _check_plan(plan: RunPlan, info: DistInfo, overwrite: bool) -> None:
    """Refuse what cannot train: fsdp in one process, splits shorter than one window, a run
    directory that cannot be used (LoRA targets or --freeze items that name nothing are
    refused by `_build_model`, also before the run directory is touched)."""
    if plan.train_cfg.compute.fsdp and info.world_size == 1:
        raise UserError(
            "fsdp needs several processes: run under torchrun (`torchrun "
            "--nproc_per_node N -m decoderlm train ...`), or pass --fsdp false to "
            "train (or resume) in one process"
        )
    check_split("train", plan.train_ids, plan.model_cfg.block_size)
    check_split("validation", plan.val_ids, plan.model_cfg.block_size)
    check_sinks(plan.train_cfg)
    _check_run_dir(plan.out_dir, overwrite, plan.checkpoint)


def _check_run_dir(out_dir: Path, overwrite: bool, checkpoint: Path | None) -> None:
    """Refuse an --out that is a file, is not writable, or holds an earlier run (unless
    --overwrite or resuming it)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} is a file, not a directory")
    held = [name for name in _RUN_FILES if (out_dir / name).exists()]
    if checkpoint is None and held and not overwrite:
        raise UserError(
            f"{out_dir} already holds a run ({', '.join(held)}); pass --resume "
            f"{out_dir} to continue it, --overwrite to replace it, or choose "
            f"another --out"
        )
    existing = next(p for p in (out_dir / "checkpoints", out_dir, *out_dir.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot write into {existing} (permission denied); choose another "
            f"--out or fix its permissions"
        )


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


def _build_model(plan: RunPlan, info: DistInfo, device: torch.device) -> DecoderLM:
    """The model to train on `device`: new (seeded with the training seed) or the checkpoint's.
    Every rank starts from the same weights and then draws its own dropout."""
    torch.manual_seed(plan.train_cfg.data.seed)
    if plan.checkpoint is not None:
        model = plan.resumed
    elif plan.base is not None:
        model = DecoderLM(plan.model_cfg)
        model.load_state_dict(plan.base.state_dict())
        plan.base = None  # the run's model holds the weights now
    else:
        model = DecoderLM(plan.model_cfg)
    prepare_trainable(model, plan.train_cfg.finetune)
    plan.lora = lora_entry(model, plan.train_cfg.finetune)
    model = model.to(device)
    if info.world_size > 1:
        torch.manual_seed(plan.train_cfg.data.seed + info.rank)
    return model


def _log_start(plan: RunPlan, model: DecoderLM, info: DistInfo, device: torch.device, log) -> None:
    cfg, train_cfg = plan.model_cfg, plan.train_cfg
    log(
        f"data: {plan.source}, vocabulary {plan.tokenizer.vocab_size}, train "
        f"{len(plan.train_ids):,} / validation {len(plan.val_ids):,} tokens"
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


def _save_run(model: DecoderLM, result: TrainResult, plan: RunPlan, info: DistInfo, device):
    """Write the trained model and its tokenizer into the run directory (rank 0); returns the
    model written. Under torchrun the full weights are read back from the last checkpoint."""
    final = (
        load_model(result.checkpoint, map_location=str(device), merge=False)
        if info.world_size > 1
        else model
    )
    final.save_pretrained(plan.out_dir, plan.extra)
    plan.tokenizer.save_pretrained(plan.out_dir)
    return final


def _summarize(plan: RunPlan, result: TrainResult, log) -> RunSummary:
    """The RunSummary, and the closing lines (how to resume, or the final loss and files)."""
    if result.interrupted:
        log(f"resume with: {resume_command(plan.out_dir)}")
        return RunSummary(
            plan.out_dir,
            None,
            None,
            result.elapsed_s,
            result.tokens_per_s,
            plan.source,
            result.step,
            True,
        )
    summary = RunSummary(
        plan.out_dir,
        result.val_loss,
        result.val_loss / LN2,
        result.elapsed_s,
        result.tokens_per_s,
        plan.source,
        result.step,
    )
    unit = "char" if isinstance(plan.tokenizer, CharTokenizer) else "token"
    log(
        f"final validation loss {summary.val_loss:.4f} nats/{unit} = {summary.val_bpc:.4f} "
        f"bits/{unit} (whole validation split), {result.elapsed_s:.1f} s of training at "
        f"{result.tokens_per_s:,.0f} tokens/s"
    )
    written = [
        f"{name}/" if (plan.out_dir / name).is_dir() else name
        for name in _RUN_FILES
        if (plan.out_dir / name).exists()
    ]
    if plan.lora:
        written = [
            f"{n} (LoRA adapters over {plan.init_from['path']})" if n == ADAPTER_NAME else n
            for n in written
        ]
    log(f"wrote {plan.out_dir}/: {' '.join(written)}")
    log(export_summary(plan.model_cfg, plan.out_dir, adapters=bool(plan.lora)))
    return summary
