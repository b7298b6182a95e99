"""The `decoderlm` command: train | prepare | eval | sample | serve | presets | params | inspect |
merge.

Each command is the plain function of the same name below (`eval` is `evaluate`): its signature
and docstring are the command's flags and --help, read by jsonargparse; `train` also takes
every ModelConfig field and every TrainConfig field as a flag. Flags are written
with dashes (`--max-steps`), booleans as `--flag`, `--flag true` or `--flag false`, an unset
optional value as `none`, and a list flag is repeated for each value.
`--config FILE` reads the flags of a command from a YAML, JSON or TOML (a .toml name) file
whose keys are the flags' names with underscores; `train`'s model and training settings sit
under `model:` and `train:`. The flags on the command line override the file.

User mistakes (bad flags, missing files, unknown characters, ...) print one line
`decoderlm: error: ...` and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import sys
import threading
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, set_loader
from jsonargparse.typing import NonNegativeInt, NotEmptyStr, PositiveInt

from .config import DtypeName, ModelConfig, TrainConfig, canonical_dtype
from .errors import MissingFileError, UserError, checked_device, flag_name, one_of
from .presets import PRESETS

__all__ = ["COMMANDS", "build_parser", "main"]

PresetName = Literal[tuple(sorted(PRESETS))]


def train(
    preset: PresetName | None = None,
    data: NotEmptyStr | None = None,
    dataset: str | None = None,
    max_chars: NonNegativeInt | None = None,
    out: NotEmptyStr | None = None,
    overwrite: bool = False,
    resume: NotEmptyStr | None = None,
    init_from: NotEmptyStr | None = None,
    merge: bool = False,
    device: str | None = None,
    no_progress: bool = False,
    nproc_per_node: PositiveInt | None = None,
    model: dict[str, Any] | None = None,
    train: dict[str, Any] | None = None,
    threads: str | None = None,
) -> int:
    """Train a GPT-style model.

    With no arguments: the 'default' preset, a character model of the embedded WikiText-2
    crop. Settings come from the preset, then the settings file (--config FILE), then the
    flags below (each ModelConfig / TrainConfig field). Under torchrun every process runs
    this; rank 0 writes the files.

    Args:
        preset: named settings (default: 'default').
        data: a UTF-8 text file, a directory with wiki.train.raw or train.txt (its train
            split), or a directory made by `decoderlm prepare` (default: the embedded first
            300,000 characters of WikiText-2 raw, validation split).
        dataset: e.g. wikitext-2-raw-v1 through the optional `datasets` package (needs the
            network).
        max_chars: use only the first N characters (0: all).
        out: run directory (default: runs/<preset>, or runs/<preset>-2, ... if taken).
        overwrite: replace a run already in --out (its files are deleted just before
            training).
        resume: continue the run in DIR from its newest checkpoint (settings such as
            --max-steps may change; the model and data may not).
        init_from: fine-tune: start from the weights of a decoderlm run directory or a
            Hugging Face GPT-2 directory (config.json + model.safetensors or
            pytorch_model.bin); the model's shape and tokenizer come from it (only --dropout
            may change, and --block-size N may crop its context to N positions), the data
            are encoded with its tokenizer, the optimizer and schedule start fresh, and the
            preset defaults to 'finetune' (lr 3e-4, 20 warm-up steps, 300 steps; see
            `decoderlm presets`; a preset's model settings do not apply).
            With --lora-rank R the run trains LoRA adapters alone and saves them alone
            (adapter.safetensors).
        merge: after training with LoRA adapters, also write the merged model to
            <out>/merged/ (an ordinary model directory).
        device: cpu, cuda, ... (default: cuda if available).
        no_progress: print neither the progress bar nor the evaluation lines (metrics.jsonl
            still has them).
        nproc_per_node: train with N processes on this machine, started through torchrun
            (--standalone; DDP, or FSDP with --fsdp); Ctrl-C stops them all after a
            checkpoint, as it stops one process. Under a torchrun of your own, leave it out.
        model: ModelConfig fields to change (the flags of the model settings).
        train: TrainConfig fields to change (the flags of the training settings).
        threads: CPU threads: N (at most the machine's CPUs), or auto (time a few training
            steps at 1, 2, ... threads on this machine as it is loaded now and keep the
            fastest; while training, re-time them when steps slow down or every 300 steps
            and move to the fastest); default torch's (the usable cores).
            OMP_WAIT_POLICY=PASSIVE in the environment makes idle threads sleep instead of
            spinning.
    """
    from .training.run import run_experiment
    from .training.threads import parse_threads

    for section, fields in (("model", model), ("train", train)):
        if not isinstance(fields, dict | None):
            raise UserError(
                f"`{section}` in the settings file must map fields to values, got {fields!r}"
            )
    if resume and overwrite:
        raise UserError("--resume continues a run and --overwrite replaces one; pick one")
    run_experiment(
        preset=preset,
        data=data,
        out=out,
        overwrite=overwrite,
        max_chars=max_chars,
        dataset=dataset,
        model_overrides=model,
        train_overrides=train,
        device=checked_device(device),
        progress=not no_progress,
        resume=resume,
        init_from=init_from,
        merge=merge,
        threads=parse_threads(threads),
    )
    return 0


def prepare(
    out: NotEmptyStr,
    data: list[NotEmptyStr] | None = None,
    dataset: str | None = None,
    tokenizer: Literal["char", "byte", "gpt2"] = "char",
    val_fraction: float = 0.1,
    overwrite: bool = False,
    eot: bool = False,
    endoftext: Literal["text", "special", "error"] = "text",
) -> int:
    """Tokenize text files into train.bin / val.bin.

    Stream text files through a tokenizer into DIR/train.bin (the first 1 - F of the token
    stream) and DIR/val.bin (the last F), np.uint16 or np.uint32, with DIR/meta.json; see
    decoderlm.data.prepare. A directory with train/valid/test files (train.txt, valid.txt,
    test.txt or WikiText's wiki.train.raw, ...) keeps its splits: train.bin from train,
    val.bin from valid, test never read. Each file is a document: with several files, the
    end-of-text token (GPT-2's <|endoftext|>, or --eot) follows each one.

    Args:
        out: the token directory to write.
        data: UTF-8 text files, or directories (their *.txt files, or the splits of a
            train/valid/test directory), encoded in this order; repeat --data for each
            (give --data or --dataset).
        dataset: e.g. wikitext-2-raw-v1 (train split) through the optional `datasets`
            package (needs the network).
        tokenizer: char: the corpus's characters plus an unknown token U+FFFD; byte: the 256
            UTF-8 bytes (any file); gpt2: GPT-2's BPE.
        val_fraction: the last F of the tokens form val.bin, in [0, 1) (unused when the
            input has a valid file).
        overwrite: replace a token directory already in --out.
        eot: give a char or byte vocabulary the end-of-text token <|endoftext|> (GPT-2
            has it always).
        endoftext: what the text's own <|endoftext|> strings are: text (ordinary
            characters, the default), special (the end-of-text token: document separators)
            or error (refused, tiktoken's default); special and error need an end-of-text
            token (gpt2, or --eot).
    """
    from .data.prepare import prepare as prepare_tokens

    one_of(data=data, dataset=dataset)
    prepare_tokens(
        data, tokenizer, out, val_fraction, overwrite, dataset, eot=eot, endoftext=endoftext
    )
    if val_fraction == 0:
        print(
            "note: --val-fraction 0 leaves val.bin empty; `decoderlm train` needs a "
            "validation split and will refuse this directory"
        )
    return 0


def evaluate(
    run: NotEmptyStr,
    data: NotEmptyStr | None = None,
    split: Literal["val", "train"] | None = None,
    json: bool = False,
    device: str = "cpu",
    batch_size: PositiveInt = 32,
) -> int:
    """Loss, bits per character and perplexity of a run.

    Score a run on a whole split of its own data (--split), a prepared token directory or a
    text file (--data): mean next-token loss over non-overlapping block_size windows.

    Args:
        run: a run directory.
        data: a text file (scored whole, unknown characters mapped to the run's unknown token
            and counted; its <|endoftext|> strings are ordinary text) or a prepared token
            directory (default: the data the run was trained on).
        split: split of the run's data or of a token directory (default: val).
        json: print JSON instead of text.
        device: cpu, cuda, ...
        batch_size: windows per forward pass.
    """
    from .evaluate import evaluate_run, format_report

    report = evaluate_run(run, data, split, checked_device(device), batch_size)
    print(_json_text(report) if json else format_report(report))
    return 0


def sample(
    run: NotEmptyStr | None = None,
    hf: NotEmptyStr | None = None,
    device: str = "cpu",
    prompt: list[str] | None = None,
    prompt_file: str | None = None,
    num_samples: PositiveInt = 1,
    stop: list[str] | None = None,
    max_new_tokens: NonNegativeInt = 500,
    temperature: float = 1.0,
    top_k: PositiveInt | None = None,
    top_p: float | None = None,
    seed: NonNegativeInt | None = None,
    compile: bool = False,
    block_size: PositiveInt | None = None,
    only_new: bool = False,
) -> int:
    """Print text sampled from a trained model.

    Sample a continuation of each prompt and print the prompt followed by it (as
    transformers and nanoGPT do), samples separated by a line `---`; with several prompts
    each sample starts with a line `### prompt I of N` (`, sample J of M` with several
    samples). A prompt's <|endoftext|> is the end-of-text token where the vocabulary has one
    (as nanoGPT's sample.py encodes it); elsewhere it is ordinary text.

    Args:
        run: a run directory (give --run or --hf).
        hf: a Hugging Face GPT-2 checkpoint directory (config.json + model.safetensors);
            GPT-2 BPE tokenizer.
        device: cpu, cuda, ...
        prompt: text to continue; repeat for several (default: <|endoftext|> where the
            vocabulary has it, as for GPT-2; else a newline, or the first character of a
            character vocabulary without one).
        prompt_file: a UTF-8 file of prompts, one per line.
        num_samples: samples per prompt (sample i uses seed + i).
        stop: end a sample where this text appears (not printed); repeatable.
        max_new_tokens: tokens to sample.
        temperature: 0 is greedy.
        top_k: sample among the K likeliest tokens.
        top_p: sample among the likeliest tokens whose probabilities sum to P.
        seed: the same seed gives the same text.
        compile: decode with torch.compile: faster per token after a one-time compile
            (needs a C++ compiler on the CPU).
        block_size: crop the model's context to N positions (at most its block_size;
            DecoderLM.crop_block_size): it then sees at most the last N tokens.
        only_new: print only the continuation, not the prompt (the default prompt is never
            printed).
    """
    from .finetune.sources import load_model_and_tokenizer
    from .generation.generate import stream_text
    from .tokenizers import CharTokenizer

    model, tokenizer = load_model_and_tokenizer(run, hf, device)
    if block_size is not None:
        model.crop_block_size(block_size)
    prompts = list(prompt or []) + (_read_prompts(prompt_file) if prompt_file else [])
    only_new = only_new or not prompts
    if not prompts:  # the start of a document
        if tokenizer.eot_token is not None:
            prompts = ["<|endoftext|>"]
        elif isinstance(tokenizer, CharTokenizer):
            prompts = ["\n" if "\n" in tokenizer.stoi else tokenizer.chars[0]]
        else:
            prompts = ["\n"]
    if not all(prompts):
        raise UserError("a prompt is empty; give at least one character")
    encoded = [tokenizer.encode(p, allowed_special="all") for p in prompts]  # all checked first
    for n, ids in enumerate(encoded):
        for i in range(num_samples):
            if n or i:
                print("\n---")
            if len(prompts) > 1:
                of_m = f", sample {i + 1} of {num_samples}" if num_samples > 1 else ""
                print(f"### prompt {n + 1} of {len(prompts)}{of_m}")
            if not only_new:
                sys.stdout.write(prompts[n])
            _print_stream(
                stream_text(
                    model,
                    tokenizer,
                    ids,
                    max_new_tokens,
                    temperature,
                    top_k,
                    top_p,
                    None if seed is None else seed + i,
                    stop,
                    compile,
                )
            )
    return 0


def serve(
    run: NotEmptyStr | None = None,
    hf: NotEmptyStr | None = None,
    device: str = "cpu",
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: NotEmptyStr | None = None,
    max_tokens_limit: PositiveInt = 1024,
    max_prompt_tokens: PositiveInt = 4096,
    max_logprobs: NonNegativeInt = 5,
    max_stop: NonNegativeInt = 16,
    max_batch_size: PositiveInt = 8,
    compile: bool = False,
) -> int:
    """An OpenAI-style HTTP API for a model.

    Serve POST /v1/completions (with echo and logprobs), GET /v1/models, the tokenizer
    endpoints POST /tokenize, POST /detokenize, GET /tokenizer_info (vLLM's shapes, which
    lm-evaluation-harness reads) and GET /health; concurrent requests are decoded in one batch
    (needs the [serve] extra: FastAPI and uvicorn). A prompt's <|endoftext|> is the
    end-of-text token where the vocabulary has one, as in `decoderlm sample`.

    Args:
        run: a run directory (give --run or --hf).
        hf: a Hugging Face GPT-2 checkpoint directory (config.json + model.safetensors);
            GPT-2 BPE tokenizer.
        device: cpu, cuda, ...
        host: the address to listen on.
        port: the TCP port to listen on, in [1, 65536).
        served_model_name: the model id clients send (default: the directory's name).
        max_tokens_limit: the largest max_tokens a request may ask for.
        max_prompt_tokens: the longest prompt accepted, in tokens.
        max_logprobs: the largest logprobs a request may ask for, at most 20.
        max_stop: the most stop strings in a request.
        max_batch_size: the most sequences decoded together; more requests wait.
        compile: decode with torch.compile: faster per token after a one-time compile
            at start (needs a C++ compiler on the CPU).
    """
    args = dict(locals())
    from .serve.app import serve as serve_command

    return serve_command(**args)


def presets() -> int:
    """List the named presets."""
    from .model.analysis import count_parameters

    for name, preset in PRESETS.items():
        if not preset.model:  # "finetune": the model comes from --init-from
            print(f"{name} (the model of --init-from SRC): {preset.description}")
            print(f"    train: {preset.train}")
            continue
        total = count_parameters(ModelConfig.from_dict(preset.model))["total"]
        print(f"{name} ({total:,} parameters): {preset.description}")
        print(f"    model: {preset.model}")
        if preset.train:
            print(f"    train: {preset.train}")
    return 0


def params(
    preset: PresetName | None = None,
    run: NotEmptyStr | None = None,
    model_config: NotEmptyStr | None = None,
    batch_size: PositiveInt = 1,
    seq_len: PositiveInt | None = None,
    dtype: DtypeName = "float32",
    json: bool = False,
    freeze: str | None = None,
    lora_rank: PositiveInt | None = None,
    lora_targets: str | None = None,
) -> int:
    """Parameter, FLOP and memory counts of a model.

    Closed-form parameter count (checked against a model built on the meta device), FLOPs
    per token and memory, from hyperparameters.

    Args:
        preset: the model of a preset (give one of --preset, --run, --model-config).
        run: the model of a run directory.
        model_config: a run's config.json, or ModelConfig fields in a YAML, JSON or TOML
            (.toml) file (optionally under `model`).
        batch_size: sequences per batch for the memory figures.
        seq_len: sequence length T (default: block_size).
        dtype: the number format for the memory figures (fp32, bf16, fp16 are the same as
            float32, bfloat16, float16, here and in train).
        json: print JSON instead of a table.
        freeze: count as trainable only what this --freeze of `decoderlm train` leaves
            (default: a run's own setting).
        lora_rank: count the parameters of LoRA adapters of this rank on --lora-targets,
            which alone train (default: a run's own setting).
        lora_targets: the layers with adapters (default: a run's, or qkv).
    """
    import torch

    from .model.analysis import count_parameters, flops_per_token, memory_bytes
    from .model.model import DecoderLM
    from .presets import get_preset

    one_of(preset=preset, run=run, model_config=model_config)
    data = None
    if preset:
        config = ModelConfig.from_dict(get_preset(preset).model)
    else:
        path = Path(run or model_config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise MissingFileError(f"{path} not found")
        data = _read_settings(path, "n_layers: 12")
        config = ModelConfig.from_dict(data.get("model", data))
    counts = count_parameters(config)
    with torch.device("meta"):  # the real modules, without allocating their memory
        built = DecoderLM(config).num_parameters()
    if built != counts["total"]:
        raise RuntimeError(f"internal error: formula {counts['total']} != modules {built}")
    T = seq_len or config.block_size
    report = {
        "config": config.to_dict(),
        "parameters": counts,
        "parameters_of_modules": built,
        "vocabulary": {
            "tokens": config.vocab_size,
            "rows": config.vocab_rows,
            "padding_rows": config.vocab_rows - config.vocab_size,
        },
        "flops_per_token": {c: flops_per_token(config, T, c) for c in ("kaplan", "palm")},
        "memory_bytes": memory_bytes(config, batch_size, T, dtype),
        "memory_bytes_checkpointed": memory_bytes(config, batch_size, T, dtype, True),
        "batch_size": batch_size,
        "seq_len": T,
        "dtype": canonical_dtype(dtype),
        "trainable": _trainable_report(
            config,
            {"freeze": freeze, "lora_rank": lora_rank, "lora_targets": lora_targets},
            data.get("train") if run and isinstance(data, dict) else None,
        ),
    }
    print(_json_text(report) if json else _params_table(report))
    return 0


def inspect(
    run: NotEmptyStr | None = None,
    hf: NotEmptyStr | None = None,
    text: str | None = None,
    text_file: str | None = None,
    out: NotEmptyStr = "report.html",
    layers: list[NonNegativeInt] | None = None,
    max_tokens: PositiveInt = 128,
    corrupt: str | None = None,
    device: str = "cpu",
) -> int:
    """Write an HTML report of what a model does on a text.

    One self-contained HTML file (nothing fetched; opens offline) with views linked by
    hovering a token: the text coloured by surprisal (bits) with the top guesses, the
    attention of every layer and head, previous-token / duplicate-token / induction head
    scores, the logit lens, the embedding map, and activation patching with --corrupt; the
    same data as JSON beside it (same name, .json). See decoderlm.lens.report.

    Args:
        run: a run directory (give --run or --hf).
        hf: a Hugging Face GPT-2 checkpoint directory (config.json + model.safetensors).
        text: the text to look at (give --text or --text-file); its <|endoftext|> is the
            end-of-text token where the vocabulary has one, as in a prompt.
        text_file: a UTF-8 file holding the text.
        out: the HTML file to write.
        layers: layers whose attention maps are stored (default: all); repeat for several.
        max_tokens: use the first N tokens of the text (at most the model's context).
        corrupt: a corrupted text with as many tokens as the text (after --max-tokens): adds
            the patching view (metric: the clean run's top next token against the corrupted
            run's).
        device: cpu, cuda, ...
    """
    from .finetune.sources import load_model_and_tokenizer
    from .lens.report import build_report, write_report

    one_of(text=text, text_file=text_file)
    if Path(out).is_dir() or out.endswith("/") or Path(out).suffix == ".json":
        raise UserError(
            f"--out {out} must name the HTML file (its data go beside it as .json), "
            f"e.g. --out {Path(out).with_suffix('') / 'report.html'}"
        )
    if text_file is not None:
        text = _read_text(text_file, "--text-file")
    model, tokenizer = load_model_and_tokenizer(run, hf, device)
    n = min(max_tokens, model.config.max_positions)
    ids = tokenizer.encode(text, allowed_special="all")[:n]  # as a prompt
    corrupted = None if corrupt is None else tokenizer.encode(corrupt, allowed_special="all")[:n]
    title = f"{run or hf}: {tokenizer.decode(ids)[:80]!r}"
    report = build_report(model, tokenizer, ids, layers, corrupted, title=title)
    html, data = write_report(report, out)
    print(f"wrote {html} ({html.stat().st_size:,} bytes) and {data} ({len(ids)} tokens)")
    return 0


def _params_table(report: dict) -> str:
    """The report of `params` as text."""
    counts, built, T = report["parameters"], report["parameters_of_modules"], report["seq_len"]
    gib = 2**30
    lines = [
        (
            f"parameters: {counts['total']:,} (modules on the meta device: {built:,}); "
            f"non-embedding (total minus the position table) {counts['non_embedding']:,}"
        )
    ]
    lines += [
        f"  {part:<11} {counts[part]:>15,}"
        for part in ("embeddings", "attention", "mlp", "norms", "head")
    ]
    vocab = report["vocabulary"]
    if vocab["padding_rows"]:
        lines.append(
            f"vocabulary: {vocab['tokens']:,} tokens in {vocab['rows']:,} embedding rows "
            f"({vocab['padding_rows']:,} padding rows, counted above, never produced)"
        )
    k, p = report["flops_per_token"]["kaplan"], report["flops_per_token"]["palm"]
    lines.append(
        f"FLOPs per token at T={T}: forward {k['forward']:,}, training "
        f"{k['training']:,} (Kaplan: causal attention); PaLM convention (full T x T): "
        f"training {p['training']:,}; per sequence (Kaplan): training "
        f"{k['training_per_sequence']:,}"
    )
    m, c = report["memory_bytes"], report["memory_bytes_checkpointed"]
    lines.append(f"memory at batch {report['batch_size']}, T={T}, {report['dtype']}:")
    lines += [
        f"  {key:<15} {m[key]:>16,} bytes = {m[key] / gib:9.3f} GiB"
        for key in (
            "weights",
            "gradients",
            "adamw",
            "activations",
            "training_total",
            "training_peak",
            "kv_cache",
        )
    ]
    lines.append(
        f"  activations with activation checkpointing: {c['activations'] / gib:.3f} GiB"
        f" (training total {c['training_total'] / gib:.3f} GiB)"
    )
    t = report.get("trainable")
    if t:
        lines.append(
            f"trainable: {t['trainable']:,} of {t['total']:,} parameters"
            + (
                f"; LoRA adapters {t['adapters']:,} = r (d_in + d_out) summed over "
                f"{t['adapted_layers']} layers"
                if t["adapters"]
                else ""
            )
        )
    return "\n".join(lines)


def _trainable_report(config: ModelConfig, given: dict, saved: dict | None) -> dict | None:
    """Trainable and total parameter counts under freeze / LoRA settings (`given`, else a
    run's saved `train` entry), from the real modules on the meta device; None when every
    parameter trains."""
    import torch

    from .finetune.trainable import prepare_trainable, trainable_counts
    from .model.lora import LoRALinear, lora_parameter_count
    from .model.model import DecoderLM

    saved = saved if isinstance(saved, dict) else {}
    settings = {k: v if v is not None else saved.get(k) for k, v in given.items()}
    settings = {k: v for k, v in settings.items() if v is not None}
    if not settings.get("freeze") and not settings.get("lora_rank"):
        return None
    with torch.device("meta"):
        model = DecoderLM(config)
        prepare_trainable(model, TrainConfig.from_dict(settings))
    counts = trainable_counts(model)
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    shapes = [(m.out_features, m.in_features) for m in layers]
    closed_form = lora_parameter_count(shapes, settings.get("lora_rank") or 0)
    if counts["adapters"] != closed_form:
        raise RuntimeError(f"internal error: formula {closed_form} != adapters {counts}")
    return {**counts, "adapted_layers": len(layers), **settings}


def merge(run: NotEmptyStr, out: NotEmptyStr) -> int:
    """Merge a LoRA run's adapters into an ordinary model directory.

    Write the model of a run trained with --lora-rank, its adapters folded into the weights
    (W + (alpha / r) B A), as a model directory (model.safetensors, config.json, the
    tokenizer files) whose logits equal the adapted model's; `sample`, `eval`, `serve` and
    the GPT-2 export take it without the base model.

    Args:
        run: the LoRA run (or one of its checkpoints); its base model must be where the run
            recorded it.
        out: the new model directory (must not exist, or be empty).
    """
    from .finetune.merge import merge_run

    print(
        f"wrote {merge_run(run, out)}/: model.safetensors config.json tokenizer.json "
        f"decoderlm_tokenizer.json"
    )
    return 0


# ---- helpers of the commands ----


def _json_text(report: dict) -> str:
    return json.dumps(report, indent=2, ensure_ascii=False)


def _read_text(path: str, flag: str) -> str:
    """The text of the UTF-8 file given to `flag`; ValueError naming the flag otherwise."""
    if Path(path).is_dir():
        raise UserError(f"{flag} {path} is a directory; give a text file")
    if not Path(path).exists():
        raise UserError(f"{flag} {path} not found")
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text") from None


def _read_prompts(path: str) -> list[str]:
    """The prompts of a UTF-8 file, one per line; no line may be empty."""
    lines = _read_text(path, "--prompt-file").splitlines()
    if not lines:
        raise UserError(f"{path} holds no prompts")
    blank = [i + 1 for i, line in enumerate(lines) if not line]
    if blank:
        raise UserError(f"{path}: line {blank[0]} is empty; one prompt per line")
    return lines


def _print_stream(pieces) -> None:
    """Print a sample's text as stream_text produces it, then a newline."""
    for delta, *_ in pieces:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()


# ---- the command line, built from the functions above ----

COMMANDS = {
    "train": train,
    "prepare": prepare,
    "eval": evaluate,
    "sample": sample,
    "serve": serve,
    "presets": presets,
    "params": params,
    "inspect": inspect,
    "merge": merge,
}
_METAVARS = {
    "run": "DIR",
    "hf": "DIR",
    "out": "DIR",
    "resume": "DIR",
    "init_from": "SRC",
    "data": "PATH",
    "dataset": "NAME",
    "prompt_file": "FILE",
    "model_config": "FILE",
    "stop": "TEXT",
    "text": "TEXT",
    "text_file": "FILE",
    "corrupt": "TEXT",
}
_UNIONS = (typing.Union, types.UnionType)
_KINDS = {
    NonNegativeInt: "an integer >= 0",
    PositiveInt: "an integer > 0",
    NotEmptyStr: "a non-empty string",
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "text",
    type(None): "none",
}


_FILE_ERRORS = [  # jsonargparse's words for a bad settings file -> ours
    (
        r"^Subcommand '\w+' does not accept option '(.*)'$",
        r"unknown setting '\1' in the settings file (keys: the flags' names, with underscores)",
    ),
    (r"^Problems parsing config: ", "the settings file does not parse: "),
    (r"^Unexpected config: .*", "a settings file must map settings to values"),
]


def _load(text: str, path: str = "") -> Any:
    """Read a settings file (TOML if its name ends in .toml, JSON if in .json, else YAML) or a
    flag's value (YAML; `none` means None as `null` does). A .json name is read as JSON, whose
    1e-05 is a number (YAML 1.1 reads it as text)."""
    if str(path).endswith(".toml"):
        return tomllib.loads(text)
    if str(path).endswith(".json"):
        return json.loads(text)
    value = yaml.safe_load(text)
    return None if value in ("none", "None") else value


_PARSE_ERRORS = (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError)
set_loader("decoderlm", _load, exceptions=_PARSE_ERRORS)


@functools.cache
def _repeatable(action_class: type) -> type:
    """A subclass of jsonargparse's action for a list whose flag appends one value each time
    it is given (--stop a --stop b), as jsonargparse's flag with a "+" (--stop+ a) does."""

    class Repeatable(action_class):
        def __call__(self, parser, cfg, value, option_string=None):
            super().__call__(parser, cfg, value, option_string + "+")

    return Repeatable


def _parser(**kwargs) -> ArgumentParser:
    # allow_abbrev=False: a mistyped flag such as --over is refused, never taken as --overwrite
    return ArgumentParser(
        exit_on_error=False,
        parser_mode="decoderlm",
        print_config=None,
        env_prefix=False,
        allow_abbrev=False,
        **kwargs,
    )


def build_parser() -> ArgumentParser:
    """The `decoderlm` parser: one subcommand per function in COMMANDS."""
    root = _parser(
        prog="decoderlm", description="Train, sample and inspect decoder-only language models."
    )
    root.add_argument("--version", action="version", version=f"decoderlm {_version()}")
    subcommands = root.add_subcommands(dest="command", metavar="COMMAND")
    for name, function in COMMANDS.items():
        summary, _, details = typing.cast(str, function.__doc__).partition("\n\n")
        parser = _parser(description=details.split("\n\n    Args:")[0].strip() or summary)
        if function is not presets:
            parser.add_argument(
                "--config",
                action=ActionConfigFile,
                metavar="FILE",
                help=(
                    "a YAML, JSON or TOML (.toml) file of this command's settings, named as the "
                    "flags with underscores; the flags override it"
                    + (
                        "; ModelConfig fields under `model`, TrainConfig fields under `train`"
                        if function is train
                        else ""
                    )
                ),
            )
        parser.add_function_arguments(function, as_group=False, skip={"model", "train"})
        if function is train:
            _add_settings(parser)
        _flat_flags(parser)
        if function is inspect:  # its --out is a file, not a run directory
            parser._option_string_actions["--out"].metavar = "FILE"
        subcommands.add_subcommand(name, parser, help=summary.strip().rstrip("."))
    return root


def _version() -> str:
    from . import __version__

    return __version__


def _add_settings(parser: ArgumentParser) -> None:
    """The ModelConfig and TrainConfig fields as flags of `train`, shown with the values of the
    'default' preset (vocab_size: the tokenizer's unless given)."""
    parser.add_class_arguments(ModelConfig, "model")
    parser.add_class_arguments(TrainConfig, "train")
    default = PRESETS["default"]
    shown = {
        "model": ModelConfig.from_dict(default.model).to_dict(),
        "train": TrainConfig.from_dict(default.train).to_dict(),
    }
    shown["model"]["vocab_size"] = None  # the tokenizer's
    parser.set_defaults(
        {
            f"{section}.{key}": value
            for section, fields in shown.items()
            for key, value in fields.items()
        }
    )
    for section, cls in (("model", ModelConfig), ("train", TrainConfig)):
        group = parser.groups[section]
        group.title = f"{section} settings ({cls.__name__})"
        group.description = (
            "default: the preset's; shown: the 'default' preset's "
            "(with no --preset and no --config)"
        )


def _flat_flags(parser: ArgumentParser) -> None:
    """Name every flag by its parameter or field, with dashes (--model.n_layers becomes
    --n-layers); a boolean's value is optional and a list's flag is repeatable."""
    for action in list(parser._actions):
        if action.dest in ("model", "train"):  # the loaders of a section from its own file
            _remove_action(parser, action)
            continue
        for option in action.option_strings:
            del parser._option_string_actions[option]
        action.option_strings = [
            flag_name(o[2:]) if o.startswith("--") else o
            for o in action.option_strings
            if not o.endswith("+")
        ]
        for option in action.option_strings:
            parser._option_string_actions[option] = action
        action.metavar = _METAVARS.get(action.dest, action.metavar)
        hint = getattr(action, "_typehint", None)
        options = typing.get_args(hint) if typing.get_origin(hint) in _UNIONS else (hint,)
        if hint is bool:
            action.nargs, action.const, action.metavar = "?", True, "true|false"
        elif typing.get_origin(options[0]) is Literal:  # also when None is allowed
            action.metavar = "{" + ",".join(typing.get_args(options[0])) + "}"
        elif typing.get_origin(options[0]) is list:
            action.__class__ = _repeatable(type(action))


def _remove_action(parser: ArgumentParser, action: argparse.Action) -> None:
    parser._remove_action(action)
    for group in parser._action_groups:
        if action in group._group_actions:
            group._group_actions.remove(action)
    for option in action.option_strings:
        del parser._option_string_actions[option]


def _one_line(parser: ArgumentParser, command: str | None, error: Exception) -> str:
    """A jsonargparse error as one line that names the flag, what it takes and what it got."""
    text = str(error)
    missing = re.match(r"the following arguments are required: (.*)", text)
    if missing:
        return "missing " + ", ".join(flag_name(key.strip()) for key in missing[1].split(","))
    key = re.match(r'Parser key "([^"]+)":', text)
    given = re.search(
        r"(?:Given value|Got value): ?(.*)|Not of type \w+: (.*) does not|"
        r"invalid literal for \w+\(\) with base 10: '(.*)'",
        text,
    )
    sub = parser._subcommands_action._name_parser_map.get(command) if command else None
    action = next((a for a in (sub or parser)._actions if key and a.dest == key[1]), None)
    if key and action is not None and given and hasattr(action, "_typehint"):
        return (
            f"argument {flag_name(key[1])}: expected {_kind(action._typehint)}, got "
            f"{next(g for g in given.groups() if g is not None).strip()!r}"
        )
    text = " ".join(line.strip() for line in text.splitlines()).replace(
        'Parser key "config"', "--config"
    )
    for pattern, replacement in _FILE_ERRORS:
        text = re.sub(pattern, replacement, text)
    return text


def _kind(hint) -> str:
    """What values a type hint takes, in words: "an integer", "a number or none", ..."""
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    if typing.get_origin(hint) is list:
        return "a list of " + _kind(typing.get_args(hint)[0])
    if typing.get_origin(hint) in _UNIONS:
        return " or ".join(map(_kind, typing.get_args(hint)))
    return _KINDS.get(hint, getattr(hint, "__name__", str(hint)))


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, also when the reader of stdout closes it
    early; 2 user error, 130 interrupted)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser()
    try:
        argv = _settings_file_first(argv)
        _check_settings_files(argv, command)
        settings = parser.parse_args(argv, defaults=False)
    except SystemExit as exit_:  # --help
        return exit_.code
    except ValueError as e:  # a settings file that cannot be used
        print(f"decoderlm: error: {e}", file=sys.stderr)
        return 2
    except argparse.ArgumentError as e:
        hint = f"decoderlm {command} --help" if command else "decoderlm --help"
        print(f"decoderlm: error: {_one_line(parser, command, e)} (see `{hint}`)", file=sys.stderr)
        return 2
    kwargs = settings.get(settings.command, Namespace()).as_dict()
    kwargs.pop("config", None)
    nproc = kwargs.pop("nproc_per_node", None)
    if nproc and "LOCAL_RANK" not in os.environ:  # the launcher; its workers see LOCAL_RANK
        from .training.launch import launch

        return launch(argv, nproc)
    return _run(settings.command, kwargs)


def _settings_file_first(argv: list[str]) -> list[str]:
    """argv with `--config FILE` moved just after the command, so that the flags override the
    settings file wherever they stand (jsonargparse applies both in the order given)."""
    if not argv or argv[0] not in COMMANDS:
        return argv
    files, rest, i = [], [], 1
    while i < len(argv):
        take = 2 if argv[i] == "--config" else 1 if argv[i].startswith("--config=") else 0
        (files if take else rest).extend(argv[i : i + (take or 1)])
        i += take or 1
    return argv[:1] + files + rest


def _read_settings(path: str | Path, example: str) -> dict:
    """The mapping in a YAML, JSON or TOML (a .toml name) settings file.

    Raises:
        ValueError: (one line naming the file) not UTF-8 text, does not parse, is empty or is
            not a mapping (`example` shows one).
    """
    try:
        data = _load(Path(path).read_bytes().decode("utf-8"), str(path))
    except UnicodeDecodeError:
        raise UserError(f"settings file {path} is not UTF-8 text") from None
    except _PARSE_ERRORS as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"the settings file does not parse: {path}: {first}") from None
    if not isinstance(data, dict):
        what = "is empty" if data is None else f"holds a {type(data).__name__}"
        raise UserError(
            f"a settings file must map settings to values; {path} {what} (write e.g. `{example}`)"
        )
    return data


def _check_settings_files(argv: list[str], command: str | None) -> None:
    """Refuse, with one ValueError naming the file, a settings file (`--config FILE`) that is
    not UTF-8 text, does not parse, is empty or is not a mapping, or (train) whose `model` or
    `train` entry is not a mapping. A missing file is left to the parser's own message."""
    paths = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    paths += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
    for path in paths:
        if not Path(path).is_file():
            continue
        data = _read_settings(path, "max_steps: 100")
        for section in ("model", "train") if command == "train" else ():
            if not isinstance(data.get(section, {}), dict):
                raise UserError(
                    f"`{section}` in the settings file must map fields to values ({path} has "
                    f"{data[section]!r})"
                )


def _run(command: str, kwargs: dict[str, Any]) -> int:
    """Call a command; user errors become one line on stderr and exit status 2."""
    rank = int(os.environ.get("RANK", "0"))  # under torchrun, rank 0 reports user errors
    if threading.current_thread() is threading.main_thread():  # SIGTERM ends like Ctrl-C
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        return COMMANDS[command](**kwargs)
    except BrokenPipeError:  # e.g. `decoderlm sample ... | head`: the reader has what it
        # wanted, so stop quietly and successfully; stdout goes to /dev/null so that the
        # interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError, RuntimeError) as e:
        if rank == 0 or not isinstance(e, (ValueError, FileNotFoundError)):
            print(f"decoderlm: error: {f'[rank {rank}] ' if rank else ''}{e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = (
            " (`decoderlm train --resume DIR` finishes or continues a run from its "
            "newest checkpoint)"
            if command == "train"
            else ""
        )
        print(f"decoderlm: interrupted{hint}", file=sys.stderr)
        return 130


def _interrupt(signum, frame):
    raise KeyboardInterrupt
