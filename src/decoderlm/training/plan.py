"""What a run trains, on what and where, decided before any file is touched.

`RunRequest` is what `decoderlm train` was asked for; `make_plan` turns it into a `RunPlan`:
a new run (a preset's settings and the overrides, on a freshly read corpus), a fine-tune
(the same from the weights, shape and tokenizer of --init-from) or a resumed run (the newest
checkpoint's settings, model and data); `check_plan` refuses a plan that cannot train.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import FinetuneConfig, ModelConfig, TrainConfig
from ..data.conversations import Conversations
from ..data.corpus import check_split, data_spec, load_corpus
from ..errors import UserError
from ..files import read_json
from ..finetune.init_from import finetune_config
from ..io.adapters import BaseModelError, base_record, find_base, is_adapter_dir
from ..io.load import load_run, load_source
from ..model.model import DecoderLM
from ..model.weights import CHECKPOINTS_DIR, list_checkpoints
from ..presets import get_preset
from ..tokenizers import Tokenizer, read_tokenizer
from .checkpoints import latest_checkpoint, load_trainer_state
from .metrics import check_sinks
from .parallel import DistInfo
from .run_dir import check_run_dir, free_run_dir

__all__ = ["RunRequest", "RunPlan", "make_plan", "check_plan", "checkpoint_model"]

_FINETUNE_FIELDS = tuple(f.name for f in dataclasses.fields(FinetuneConfig))
_LORA_SETTINGS = ("lora_alpha", "lora_targets", "lora_dropout")


@dataclass(frozen=True)
class RunRequest:
    """What a run was asked for: the arguments of `run_experiment` that decide its plan.

    Attributes:
        preset: named settings (None: 'default', or 'finetune' with init_from).
        data, dataset, max_chars: the corpus (see `decoderlm.data.corpus.data_spec`).
        out: the run directory (None: a free runs/<preset>).
        overwrite: replace a run already in out.
        resume: the run directory to continue from its newest checkpoint.
        init_from: the model directory whose weights a fine-tune starts from.
        merge: write the merged model after training LoRA adapters.
        base: the base model of the LoRA run resumed (or of an --init-from LoRA run) in a
            new place.
        verify: check loaded weights against the digests their config.json records.
        model_overrides: ModelConfig fields to change, {field: value}.
        train_overrides: TrainConfig settings to change, one flat {setting: value} (given
            flat, nested by section or both; stored flat).

    Raises:
        UserError: overrides that are not dicts or name no TrainConfig setting, resume with
            overwrite or with init_from.
    """

    preset: str | None = None
    data: str | Path | None = None
    dataset: str | None = None
    max_chars: int | None = None
    out: str | Path | None = None
    overwrite: bool = False
    resume: str | Path | None = None
    init_from: str | Path | None = None
    merge: bool = False
    base: str | Path | None = None
    verify: bool = True
    model_overrides: dict[str, Any] = field(default_factory=dict)
    train_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("model", "train"):
            fields = getattr(self, f"{name}_overrides")
            if not isinstance(fields, dict | None):
                raise UserError(f"{name}_overrides must map fields to values, got {fields!r}")
        if self.resume and self.overwrite:
            raise UserError("--resume continues a run and --overwrite replaces one; pick one")
        object.__setattr__(self, "model_overrides", dict(self.model_overrides or {}))
        object.__setattr__(self, "train_overrides", TrainConfig.flatten(self.train_overrides or {}))
        if self.base is not None and self.resume is None and self.init_from is None:
            raise UserError(
                "--base gives the base model of a LoRA run; use it with --resume DIR or "
                "--init-from SRC"
            )
        if self.resume is not None and self.init_from is not None:
            raise UserError(
                "--resume continues a run, which already records where it started; drop --init-from"
            )


@dataclass(frozen=True)
class RunPlan:
    """What a run trains, on what and where.

    Attributes:
        out_dir: the run directory.
        preset: the preset's name (config.json["preset"]).
        data_spec: where the corpus comes from (config.json["data_spec"], see
            `decoderlm.data.corpus.data_spec`).
        corpus: the corpus in words (config.json["data"], the run's "data:" line).
        model_cfg, train_cfg: the model's shape and how it trains.
        tokenizer: the run's tokenizer.
        train_ids, val_ids: [N] token ids of the two splits (int64 tensors, or numpy /
            memmapped arrays).
        checkpoint: resuming: the checkpoint directory continued from; None for a new run.
        resume_state: resuming: that checkpoint's trainer state (`load_trainer_state`).
        start_model: the model training starts from: the checkpoint's (resuming) or
            --init-from's (fine-tuning); None for a new model.
        init_from: fine-tuning: config.json["init_from"] (where the weights came from).
        lora: config.json["lora"] once adapters are added (`decoderlm.finetune.trainable`).
        run_options: config.json["run_options"] once the device and threads are set
            (`decoderlm.training.run_options`).
    """

    out_dir: Path
    preset: str
    data_spec: dict
    corpus: str
    model_cfg: ModelConfig
    train_cfg: TrainConfig
    tokenizer: Tokenizer
    train_ids: Any
    val_ids: Any
    checkpoint: Path | None = None
    resume_state: dict | None = None
    start_model: DecoderLM | None = None
    init_from: dict | None = None
    lora: dict | None = None
    run_options: dict | None = None

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
            "data": self.corpus,
            "data_spec": self.data_spec,
        }
        entries = (("init_from", self.init_from), ("lora", self.lora))
        extra.update({k: v for k, v in (*entries, ("run_options", self.run_options)) if v})
        return extra


def make_plan(request: RunRequest, info: DistInfo, log) -> RunPlan:
    """The plan of a resumed run (`request.resume`), a fine-tune (`request.init_from`) or a
    new run.

    Raises:
        UserError: settings, data or checkpoints that contradict each other or the request
            (the message says what to change).
    """
    plan = (
        _resumed_plan(request, info, log) if request.resume is not None else _new_plan(request, log)
    )
    if request.merge and plan.train_cfg.finetune.lora_rank is None:
        raise UserError("--merge merges LoRA adapters; this run has none (give --lora-rank R)")
    return plan


def check_plan(plan: RunPlan, info: DistInfo, overwrite: bool) -> None:
    """Refuse what cannot train: fsdp in one process, splits shorter than one window, a run
    directory that cannot be used (LoRA targets or --freeze items that name nothing are
    refused when the model is built, also before the run directory is touched).

    Raises:
        UserError: one of those.
    """
    if plan.train_cfg.compute.fsdp and info.world_size == 1:
        raise UserError(
            "fsdp needs several processes: run under torchrun (`torchrun "
            "--nproc_per_node N -m decoderlm train ...`), or pass --fsdp false to "
            "train (or resume) in one process"
        )
    check_split("train", plan.train_ids, plan.model_cfg.block_size)
    check_split("validation", plan.val_ids, plan.model_cfg.block_size)
    check_sinks(plan.train_cfg)
    check_run_dir(plan.out_dir, overwrite, resuming=plan.checkpoint is not None)


def checkpoint_model(
    checkpoint: Path, map_location: str = "cpu", verify: bool = True, base=None
) -> DecoderLM:
    """A checkpoint's model as training continues from it: LoRA layers kept, not merged
    (`decoderlm.io.load.load_run` with merge=False; base: a LoRA run's base in a new
    place)."""
    return load_run(checkpoint, map_location=map_location, merge=False, verify=verify, base=base)


def _new_plan(request: RunRequest, log) -> RunPlan:
    """A new run: the preset's settings plus the overrides, on a freshly read corpus."""
    preset = request.preset or ("finetune" if request.init_from is not None else "default")
    preset_spec = get_preset(preset)
    overrides = request.train_overrides
    settings = {**preset_spec.train, **overrides}
    if request.init_from is None and (
        settings.get("lora_rank") is not None or not preset_spec.model
    ):
        raise UserError(
            "LoRA adapters and the 'finetune' preset adapt an existing model; give "
            "--init-from SRC (a run directory or a Hugging Face GPT-2 directory)"
        )
    train_cfg = TrainConfig(**settings)
    lora_only = [k for k in _LORA_SETTINGS if k in overrides]
    if lora_only and train_cfg.finetune.lora_rank is None:
        flags = ", ".join("--" + k.replace("_", "-") for k in lora_only)
        raise UserError(
            f"{flags} set LoRA adapters, which this run has none of; give --lora-rank R"
        )
    spec = data_spec(request.data, request.dataset, request.max_chars, train_cfg.data.val_fraction)
    if spec["token_dir"] and (request.max_chars or "val_fraction" in overrides):
        raise UserError(
            "--max-chars and --val-fraction do not apply to a prepared token "
            "directory: its split was fixed by `decoderlm prepare` (run it "
            "again with --val-fraction)"
        )
    if request.init_from is not None:
        return _finetune_plan(request, preset, spec, train_cfg, log)
    tokenizer, train_ids, val_ids, corpus, fingerprint = load_corpus(spec)
    model_cfg = ModelConfig.from_dict(
        {**preset_spec.model, **_vocab_settings(request.model_overrides, tokenizer.vocab_size)}
    )
    return RunPlan(
        out_dir=_out_dir(request, preset),
        preset=preset,
        data_spec={**spec, "fingerprint": fingerprint},
        corpus=corpus,
        model_cfg=model_cfg,
        train_cfg=train_cfg,
        tokenizer=tokenizer,
        train_ids=train_ids,
        val_ids=val_ids,
    )


def _out_dir(request: RunRequest, preset: str) -> Path:
    """--out, or the first free runs/PRESET[-N] for a new run."""
    return Path(request.out) if request.out is not None else free_run_dir(preset)


def _vocab_settings(model_overrides: dict, n_tokens: int) -> dict:
    """model_overrides with vocab_size the tokenizer's n_tokens. A vocab_size asked for that is
    larger becomes padded_vocab_size (rows never produced); a smaller one is a UserError."""
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
    request: RunRequest, preset: str, spec: dict, train_cfg: TrainConfig, log
) -> RunPlan:
    """A new run from the weights of `request.init_from`: its shape (dropout may change) and
    tokenizer, the corpus encoded with that tokenizer (characters outside a char vocabulary
    mapped to its unknown token, and counted)."""
    init_source = load_source(request.init_from, verify=request.verify, base=request.base)
    base = init_source.model
    context = request.model_overrides.get("block_size")
    if context is not None and context != base.config.block_size:
        base.crop_block_size(context)  # a fine-tune may shorten the context, not grow it
    model_cfg = finetune_config(base.config, request.model_overrides)
    spec = {**spec, "unknown": "unk"}
    tokenizer, train_ids, val_ids, corpus, fingerprint = load_corpus(spec, init_source.tokenizer)
    if tokenizer.to_dict() != init_source.tokenizer.to_dict():
        raise UserError(
            f"{spec['token_dir']} was prepared with another tokenizer ({tokenizer!r}) than "
            f"{request.init_from}'s ({init_source.tokenizer!r}); pass the text file to encode "
            f"it with the model's tokenizer"
        )
    log(f"fine-tuning from {init_source.info['path']} ({init_source.info['kind']} weights)")
    _note_long_conversations(train_ids, val_ids, model_cfg.block_size, log)
    out_dir = _out_dir(request, preset)
    if out_dir.resolve() == Path(init_source.info["path"]):
        raise UserError(f"--out {request.out} is the --init-from directory; choose another --out")
    return RunPlan(
        out_dir=out_dir,
        preset=preset,
        data_spec={**spec, "fingerprint": fingerprint},
        corpus=corpus,
        model_cfg=model_cfg,
        train_cfg=train_cfg,
        tokenizer=tokenizer,
        train_ids=train_ids,
        val_ids=val_ids,
        start_model=base,
        init_from=base_record(init_source.info, out_dir),
    )


def _note_long_conversations(train, val, block_size: int, log) -> None:
    """One note when conversations are longer than the context: their tokens past it are
    neither seen nor trained."""
    if not isinstance(train, Conversations):
        return
    longer = int((train.lengths > block_size).sum() + (val.lengths > block_size).sum())
    if longer:
        log(
            f"note: {longer} of {train.count + val.count} conversations are longer than block_size "
            f"{block_size} tokens; what follows their first {block_size} tokens is not trained"
        )


def _resumed_plan(request: RunRequest, info: DistInfo, log) -> RunPlan:
    """A resumed run: the checkpoint's settings (training ones may be overridden) and data,
    each request setting that contradicts them refused."""
    out_dir = Path(request.resume)
    if request.out is not None and Path(request.out).resolve() != out_dir.resolve():
        raise UserError(
            f"--resume continues the run in {out_dir} itself; drop --out "
            f"{request.out} (copy the run directory first to branch it)"
        )
    point = _resume_point(out_dir, info, log, request.verify, request.base)
    saved = read_json(point.checkpoint / "config.json")
    init_from = saved.get("init_from")
    if is_adapter_dir(point.checkpoint):  # the base where it was found: recorded anew
        found = find_base(point.checkpoint, request.base)
        init_from = base_record({**init_from, "path": str(Path(found).resolve())}, out_dir)
    if request.preset is not None and request.preset != saved.get("preset"):
        raise UserError(
            f"the checkpoint was trained with preset {saved.get('preset')!r}, "
            f"not {request.preset!r}; drop --preset to resume"
        )
    overrides = request.train_overrides
    given = {"dataset": request.dataset, "max_chars": request.max_chars}
    given["val_fraction"] = overrides.get("val_fraction")
    spec = _resumed_data_spec(saved, point.checkpoint / "config.json", request.data, given)
    _check_same("model config", saved["model"], request.model_overrides)
    finetuning = {k: v for k, v in overrides.items() if k in _FINETUNE_FIELDS}
    _check_same("fine-tuning settings", saved["train"], finetuning)
    model_cfg = ModelConfig.from_dict(saved["model"])
    train_cfg = TrainConfig.from_stored({**saved["train"], **overrides})
    tokenizer, train_ids, val_ids, corpus, fingerprint = load_corpus(spec, point.tokenizer)
    if spec.get("fingerprint") not in (None, fingerprint):
        raise UserError(
            f"the corpus at {spec['token_dir'] or spec['path']} is not the one "
            f"the checkpoint was trained on (its sha256 differs); restore it, "
            f"pass --data with the original, or start a new run"
        )
    _note_schedule_change(saved["train"], train_cfg, log)
    return RunPlan(
        out_dir=out_dir,
        preset=saved.get("preset"),
        data_spec=spec,
        corpus=corpus,
        model_cfg=model_cfg,
        train_cfg=train_cfg,
        tokenizer=tokenizer,
        train_ids=train_ids,
        val_ids=val_ids,
        checkpoint=point.checkpoint,
        resume_state=point.trainer_state,
        start_model=point.model,
        init_from=init_from,
    )


def _resumed_data_spec(saved: dict, config_path: Path, data, given: dict) -> dict:
    """The checkpoint's data_spec, with the data path moved to `data` when given (the corpus
    is then checked by its fingerprint); UserError if a given data setting contradicts it."""
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
    """Raise UserError naming each command-line value that contradicts the checkpoint."""
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


@dataclass(frozen=True)
class _ResumePoint:
    """A checkpoint a run continues from, loaded: its directory, trainer state
    (`load_trainer_state`), model (`checkpoint_model`) and tokenizer."""

    checkpoint: Path
    trainer_state: dict
    model: DecoderLM
    tokenizer: Tokenizer


def _resume_point(
    run_dir: Path, info: DistInfo, log, verify: bool = True, base=None
) -> _ResumePoint:
    """The newest checkpoint of run_dir that loads whole. A damaged newer one is skipped
    with a warning and renamed damaged-step-N (by rank 0), so it stays on disk for
    inspection but out of the keep_checkpoints rotation. Without verify the damaged-step-N
    folders are candidates too (by step; step-N before damaged-step-N): a checkpoint set
    aside because a digest check failed loads unchecked, as the warning said it would.

    Raises:
        UserError / MissingFileError: run_dir is a file, has no checkpoint, or none loads.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--resume {run_dir} is a file; give the run directory")
    aside = sorted((run_dir / CHECKPOINTS_DIR).glob(f"{_DAMAGED}*")) if run_dir.is_dir() else []
    if not list_checkpoints(run_dir) and aside and verify:
        raise UserError(
            f"{run_dir / CHECKPOINTS_DIR} holds only checkpoints set aside as damaged "
            f"({', '.join(p.name for p in aside)}); `decoderlm train --resume {run_dir} "
            f"--no-verify` tries them without checking their digests"
        )
    if verify or not aside:
        latest_checkpoint(run_dir)  # raises a clear error when there is none
    for candidate in _resume_candidates(run_dir, aside if not verify else []):
        if base is not None and not is_adapter_dir(candidate):
            raise UserError(
                f"--base gives the base model of a LoRA run; {run_dir} has no adapters (drop "
                "--base)"
            )
        find_base(candidate, base)  # a missing base model is the run's fault, not the checkpoint's
        try:
            return _ResumePoint(
                checkpoint=candidate,
                trainer_state=load_trainer_state(candidate, verify),
                model=checkpoint_model(candidate, verify=verify, base=base),
                tokenizer=read_tokenizer(candidate),
            )
        except BaseModelError:
            raise
        except (ValueError, FileNotFoundError) as e:
            if candidate.name.startswith(_DAMAGED):
                log(f"warning: skipping checkpoint {candidate}: {e}")
                continue
            moved = _free_name(candidate.with_name(_DAMAGED + candidate.name))
            hint = f" (`decoderlm train --resume {run_dir} --no-verify` tries it unchecked)"
            log(
                f"warning: skipping checkpoint {candidate}: {e}; moved it to {moved} (delete "
                f"it once you no longer need it{hint if verify else ''}) and trying the "
                "checkpoint before it"
            )
            if info.is_main:
                os.replace(candidate, moved)
    raise UserError(
        f"no checkpoint in {run_dir / CHECKPOINTS_DIR} can be loaded; see the warnings above"
    )


_DAMAGED = "damaged-"  # the prefix of a checkpoint set aside by --resume


def _resume_candidates(run_dir: Path, aside: list[Path]) -> list[Path]:
    """The checkpoints to try, newest first: run_dir's step-N and the damaged-step-N of
    `aside` (at the same step, step-N first)."""

    def order(path: Path) -> tuple[int, int]:
        found = re.match(r"(?:damaged-)?step-(\d+)", path.name)
        return (int(found[1]) if found else -1, not path.name.startswith(_DAMAGED))

    return sorted([*list_checkpoints(run_dir), *aside], key=order, reverse=True)


def _free_name(path: Path) -> Path:
    """path, or path-2, path-3, ... where it is taken (a step set aside twice)."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate
