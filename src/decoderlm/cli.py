"""The `decoderlm` command: train | prepare | eval | sample | serve | presets | params.

User mistakes (bad flags, missing files, unknown characters, ...) print one line
`decoderlm: error: ...` and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

__all__ = ["main", "build_parser"]


def _int_in(minimum: int, maximum: int | None = None):
    """An argparse type: an integer in [minimum, maximum), with a message naming the bounds."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value >= maximum):
            bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum})"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {text!r}")
        return value
    return parse


_positive_int, _non_negative_int, _seed = _int_in(1), _int_in(0), _int_in(0, 2**63)
_COMPILE_HELP = ("decode with torch.compile: faster per token after a 10-30 s compile (needs a "
                 "C++ compiler on the CPU)")


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: `decoderlm: error: ...`, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"decoderlm: error: {message} (see `{self.prog} --help`)\n")


def _setting_type(tp):
    """An argparse type for a config field of type `tp` (int, float, str, bool, or X | None,
    where "none" means None). Ranges are checked by the config classes themselves."""
    import types
    import typing

    args = typing.get_args(tp) if isinstance(tp, types.UnionType) else ()
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), tp)

    def parse(text: str):
        if optional and text.lower() in ("none", "null"):
            return None
        if base is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
            raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
        try:
            return base(text)
        except ValueError:
            kind = {int: "an integer", float: "a number"}.get(base, base.__name__)
            raise argparse.ArgumentTypeError(
                f"expected {kind}{' or none' if optional else ''}, got {text!r}") from None
    return parse, base is bool


def _settings_flags():
    """{dest: (section, field, flag, type, is_bool, help)} for every ModelConfig field but
    vocab_size (set by the tokenizer) and every TrainConfig field: --n-layers, --lr, ..."""
    import dataclasses
    import typing

    from .config import ModelConfig, TrainConfig, field_help

    flags = {}
    for section, cls in (("model", ModelConfig), ("train", TrainConfig)):
        hints, helps = typing.get_type_hints(cls), field_help(cls)
        for f in dataclasses.fields(cls):
            if f.name == "vocab_size":
                continue
            parse, is_bool = _setting_type(hints[f.name])
            flags[f"setting_{f.name}"] = (section, f.name, "--" + f.name.replace("_", "-"),
                                         parse, is_bool, helps.get(f.name, ""))
    return flags


def _device(text: str) -> str:
    import torch

    kind = text.split(":")[0]
    available = {"cpu": True, "cuda": torch.cuda.is_available(),
                 "mps": torch.backends.mps.is_available()}
    if kind not in available:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use cpu, cuda or mps")
    if not available[kind]:
        raise argparse.ArgumentTypeError(f"{kind} is not available on this machine; use "
                                         f"--device cpu")
    return text


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def build_parser() -> argparse.ArgumentParser:
    from .presets import PRESETS

    parser = _Parser(
        prog="decoderlm", description="Train, sample and inspect decoder-only language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "train", help="train a model (default: the seed experiment)",
        description="Train a GPT-style model. With no arguments: the 'default' preset, a "
        "character model of the embedded WikiText-2 crop. Settings come from the preset, then "
        "--config FILE, then the options below (each ModelConfig / TrainConfig field). Under "
        "torchrun every process runs this; rank 0 writes the files.")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="named settings (default: 'default')")
    p.add_argument("--config", metavar="FILE", type=_non_empty,
                   help="a TOML (or YAML) settings file: preset, "
                   "data, out, ... at the top, [model] and [train] tables of fields")
    p.add_argument("--data", metavar="PATH", type=_non_empty,
                   help="a UTF-8 text file, a directory with wiki.train.raw, or a directory "
                   "made by `decoderlm prepare` (default: the embedded first 300,000 "
                   "characters of WikiText-2 raw, validation split)")
    p.add_argument("--dataset", metavar="NAME",
                   help="e.g. wikitext-2-raw-v1 through the optional `datasets` package (needs "
                   "the network)")
    p.add_argument("--max-chars", type=_non_negative_int, metavar="N",
                   help="use only the first N characters (0: all)")
    p.add_argument("--out", metavar="DIR", type=_non_empty, help="run directory (default: "
                   "runs/<preset>, or runs/<preset>-2, ... if taken)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a run already in --out (its files are deleted just before "
                   "training)")
    p.add_argument("--resume", metavar="DIR", type=_non_empty,
                   help="continue the run in DIR from its newest checkpoint (settings such as "
                   "--max-steps may change; the model and data may not)")
    p.add_argument("--device", type=_device, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    model_group = p.add_argument_group("model settings (ModelConfig; default: the preset's)")
    train_group = p.add_argument_group("training settings (TrainConfig; default: the preset's)")
    for dest, (section, _, flag, parse, is_bool, text) in _settings_flags().items():
        group = model_group if section == "model" else train_group
        extra = dict(nargs="?", const=True, metavar="true|false") if is_bool else \
            dict(metavar=flag[2:].upper().replace("-", "_"))
        group.add_argument(flag, dest=dest, type=parse, help=text.replace("%", "%%"), **extra)

    r = sub.add_parser("prepare", help="tokenize text files into train.bin / val.bin",
                       description="Stream text files through a tokenizer into DIR/train.bin "
                       "(the first 1 - F of the token stream) and DIR/val.bin (the last F), "
                       "np.uint16 or np.uint32, with DIR/meta.json; see decoderlm.prepare.")
    corpus = r.add_mutually_exclusive_group(required=True)
    corpus.add_argument("--data", nargs="+", metavar="PATH",
                        help="UTF-8 text files, or directories (their *.txt files, or the "
                        "wiki.train.raw of a WikiText directory), encoded in this order")
    corpus.add_argument("--dataset", metavar="NAME",
                        help="e.g. wikitext-2-raw-v1 (train split) through the optional "
                        "`datasets` package (needs the network)")
    r.add_argument("--tokenizer", choices=["char", "byte", "gpt2"], default="char",
                   help="char: the corpus's characters plus an unknown token U+FFFD; byte: "
                   "the 256 UTF-8 bytes (any file); gpt2: GPT-2's BPE (default: %(default)s)")
    r.add_argument("--out", metavar="DIR", type=_non_empty, required=True)
    r.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                   help="the last F of the tokens form val.bin, in [0, 1) (default: %(default)s)")
    r.add_argument("--overwrite", action="store_true",
                   help="replace a token directory already in --out")

    e = sub.add_parser("eval", help="loss, bits per character and perplexity of a run",
                       description="Score a run on a whole split of its own data (--split), "
                       "a prepared token directory or a text file (--data): mean next-token "
                       "loss over non-overlapping block_size windows.")
    e.add_argument("--run", metavar="DIR", required=True, help="a run directory")
    e.add_argument("--data", metavar="PATH", type=_non_empty,
                   help="a text file (scored whole, unknown "
                   "characters mapped to the run's unknown token and counted) or a prepared "
                   "token directory (default: the data the run was trained on)")
    e.add_argument("--split", choices=["val", "train"],
                   help="split of the run's data or of a token directory (default: val)")
    e.add_argument("--json", action="store_true", help="print JSON instead of text")
    e.add_argument("--device", type=_device, default="cpu")
    e.add_argument("--batch-size", type=_positive_int, default=32, metavar="B",
                   help="windows per forward pass (default: %(default)s)")

    s = sub.add_parser("sample", help="print text sampled from a trained model",
                       description="Sample a continuation of --prompt and print it.")
    _add_model_source(s)
    s.add_argument("--prompt", action="append", help="text to continue; repeat for several "
                   "(default: a newline, or the first character of a character vocabulary "
                   "without one; <|endoftext|> for GPT-2)")
    s.add_argument("--prompt-file", metavar="FILE", help="a UTF-8 file of prompts, one per line")
    s.add_argument("--num-samples", type=_positive_int, default=1, metavar="N",
                   help="samples per prompt (sample i uses seed + i)")
    s.add_argument("--stop", action="append", metavar="TEXT",
                   help="end a sample where this text appears (not printed); repeatable")
    s.add_argument("--max-new-tokens", type=_non_negative_int, default=500, metavar="N")
    s.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default: 1.0)")
    s.add_argument("--top-k", type=_positive_int, metavar="K")
    s.add_argument("--top-p", type=float, metavar="P")
    s.add_argument("--seed", type=_seed, help="the same seed gives the same text")
    s.add_argument("--compile", action="store_true", help=_COMPILE_HELP)

    v = sub.add_parser("serve", help="an OpenAI-style HTTP API for a model",
                       description="Serve POST /v1/completions, GET /v1/models and GET /health "
                       "(needs the [serve] extra: FastAPI and uvicorn).")
    _add_model_source(v)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=_int_in(1, 65536), default=8000)
    v.add_argument("--max-tokens-limit", type=_positive_int, default=1024, metavar="N",
                   help="the largest max_tokens a request may ask for (default: %(default)s)")
    v.add_argument("--max-prompt-tokens", type=_positive_int, default=4096, metavar="N",
                   help="the longest prompt accepted, in tokens (default: %(default)s)")
    v.add_argument("--compile", action="store_true", help=_COMPILE_HELP + "; compiled at start")

    sub.add_parser("presets", help="list the named presets")

    a = sub.add_parser("params", help="parameter, FLOP and memory counts of a model",
                       description="Closed-form parameter count (checked against a model built "
                       "on the meta device), FLOPs per token and memory, from hyperparameters.")
    source = a.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS))
    source.add_argument("--config", metavar="FILE", help="a config.json (a run's, or ModelConfig "
                        "fields as a JSON object)")
    a.add_argument("--batch-size", type=_positive_int, default=1, metavar="B")
    a.add_argument("--seq-len", type=_positive_int, metavar="T", help="default: block_size")
    a.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    a.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _cmd_train(args) -> int:
    from .config import load_settings_file
    from .training.run import run_experiment

    settings = load_settings_file(args.config) if args.config else {}
    overrides = {"model": dict(settings.get("model", {})), "train": dict(settings.get("train", {}))}
    for dest, (section, name, *_) in _settings_flags().items():
        if getattr(args, dest) is not None:
            overrides[section][name] = getattr(args, dest)
    if args.resume and args.overwrite:
        raise ValueError("--resume continues a run and --overwrite replaces one; pick one")

    def pick(name):
        value = getattr(args, name)
        return value if value is not None else settings.get(name)

    run_experiment(preset=pick("preset"), data=pick("data"), out=pick("out"),
                   overwrite=args.overwrite, max_chars=pick("max_chars"),
                   dataset=pick("dataset"), model_overrides=overrides["model"],
                   train_overrides=overrides["train"], device=pick("device"),
                   progress=not args.no_progress, resume=args.resume)
    return 0


def _cmd_prepare(args) -> int:
    from .prepare import prepare

    prepare(args.data, args.tokenizer, args.out, args.val_fraction, args.overwrite,
            args.dataset)
    if args.val_fraction == 0:
        print("note: --val-fraction 0 leaves val.bin empty; `decoderlm train` needs a "
              "validation split and will refuse this directory")
    return 0


def _cmd_eval(args) -> int:
    import json

    from .evaluate import evaluate_run, format_report

    report = evaluate_run(args.run, args.data, args.split, args.device, args.batch_size)
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json
          else format_report(report))
    return 0


def _load_model_and_tokenizer(args):
    """The model and tokenizer of --run DIR or --hf DIR, checked to belong together."""
    from .evaluate import check_vocab
    from .model import DecoderLM
    from .tokenizers import GPT2Tokenizer, load_tokenizer

    if args.hf:
        from .hf import load_gpt2
        model, tokenizer = load_gpt2(args.hf, map_location=args.device), GPT2Tokenizer()
    else:
        model = DecoderLM.from_pretrained(args.run, map_location=args.device)
        tokenizer = load_tokenizer(args.run)
    check_vocab(tokenizer, model, args.run or args.hf)
    return model, tokenizer


def _add_model_source(p) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="DIR", help="a run directory")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face GPT-2 checkpoint "
                        "directory (config.json + model.safetensors); GPT-2 BPE tokenizer")
    p.add_argument("--device", type=_device, default="cpu")


def _cmd_sample(args) -> int:
    from .tokenizers import CharTokenizer

    model, tokenizer = _load_model_and_tokenizer(args)
    prompts = list(args.prompt or [])
    if args.prompt_file:
        try:
            lines = Path(args.prompt_file).read_text(encoding="utf-8-sig").splitlines()
        except UnicodeDecodeError:
            raise ValueError(f"{args.prompt_file} is not UTF-8 text") from None
        if not lines:
            raise ValueError(f"{args.prompt_file} holds no prompts")
        blank = [i + 1 for i, line in enumerate(lines) if not line]
        if blank:
            raise ValueError(f"{args.prompt_file}: line {blank[0]} is empty; one prompt per "
                             f"line")
        prompts += lines
    if not prompts:
        if isinstance(tokenizer, CharTokenizer):
            prompts = ["\n" if "\n" in tokenizer.stoi else tokenizer.chars[0]]
        else:
            prompts = ["<|endoftext|>"]
    if not all(prompts):
        raise ValueError("a prompt is empty; give at least one character")
    encoded = [tokenizer.encode(p) for p in prompts]  # every prompt checked before sampling
    first = True
    for ids in encoded:
        for i in range(args.num_samples):
            if not first:
                print("\n---")
            first = False
            seed = None if args.seed is None else args.seed + i
            _print_stream(model, tokenizer, ids, args, seed)
    return 0


def _print_stream(model, tokenizer, ids, args, seed) -> None:
    """Print a sample's text as its tokens are produced, up to the first --stop text."""
    from .generate import stream_text

    for delta, *_ in stream_text(model, tokenizer, ids, args.max_new_tokens, args.temperature,
                                 args.top_k, args.top_p, seed, args.stop, args.compile):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()


def _cmd_serve(args) -> int:
    from .serve import serve

    model, tokenizer = _load_model_and_tokenizer(args)
    name = Path(args.run or args.hf).resolve().name
    serve(model, tokenizer, name, args.host, args.port, args.max_tokens_limit,
          args.max_prompt_tokens, args.compile)
    return 0


def _cmd_presets(args) -> int:
    from .analysis import count_parameters
    from .config import ModelConfig
    from .presets import PRESETS

    for name, preset in PRESETS.items():
        total = count_parameters(ModelConfig.from_dict(preset.model))["total"]
        print(f"{name} ({total:,} parameters): {preset.description}")
        print(f"    model: {preset.model}")
        if preset.train:
            print(f"    train: {preset.train}")
    return 0


def _cmd_params(args) -> int:
    import json

    import torch

    from .analysis import count_parameters, flops_per_token, memory_bytes
    from .files import read_json
    from .config import ModelConfig
    from .presets import get_preset
    from .model import DecoderLM

    if args.preset:
        config = ModelConfig.from_dict(get_preset(args.preset).model)
    else:
        path = Path(args.config)
        data = read_json(path / "config.json" if path.is_dir() else path)
        data = data.get("model", data) if isinstance(data, dict) else data
        config = ModelConfig.from_dict(data)
    counts = count_parameters(config)
    with torch.device("meta"):  # the real modules, without allocating their memory
        built = DecoderLM(config).num_parameters()
    if built != counts["total"]:
        raise RuntimeError(f"internal error: formula {counts['total']} != modules {built}")
    T = args.seq_len or config.block_size
    report = {
        "config": config.to_dict(), "parameters": counts, "parameters_of_modules": built,
        "flops_per_token": {c: flops_per_token(config, T, c) for c in ("kaplan", "palm")},
        "memory_bytes": memory_bytes(config, args.batch_size, T, args.dtype),
        "memory_bytes_checkpointed": memory_bytes(config, args.batch_size, T, args.dtype, True),
        "batch_size": args.batch_size, "seq_len": T, "dtype": args.dtype,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    gib = 2 ** 30
    print(f"parameters: {counts['total']:,} (modules on the meta device: {built:,}); "
          f"non-embedding (total minus the position table) {counts['non_embedding']:,}")
    for part in ("embeddings", "attention", "mlp", "norms", "head"):
        print(f"  {part:<11} {counts[part]:>15,}")
    k, p = report["flops_per_token"]["kaplan"], report["flops_per_token"]["palm"]
    print(f"FLOPs per token at T={T}: forward {k['forward']:,}, training {k['training']:,} "
          f"(Kaplan: causal attention); PaLM convention (full T x T): training "
          f"{p['training']:,}; per sequence (Kaplan): training {k['training_per_sequence']:,}")
    m, c = report["memory_bytes"], report["memory_bytes_checkpointed"]
    print(f"memory at batch {args.batch_size}, T={T}, {args.dtype}:")
    for key in ("weights", "gradients", "adamw", "activations", "training_total",
                "training_peak", "kv_cache"):
        print(f"  {key:<15} {m[key]:>16,} bytes = {m[key] / gib:9.3f} GiB")
    print(f"  activations with activation checkpointing: {c['activations'] / gib:.3f} GiB "
          f"(training total {c['training_total'] / gib:.3f} GiB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, also when the reader of stdout closes it
    early; 2 user error, 130 interrupted)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a bad argument (2, message already printed)
        return exit_.code
    command = {"train": _cmd_train, "prepare": _cmd_prepare, "eval": _cmd_eval,
               "sample": _cmd_sample, "serve": _cmd_serve,
               "presets": _cmd_presets, "params": _cmd_params}
    rank = int(os.environ.get("RANK", "0"))  # under torchrun, rank 0 reports user errors
    if threading.current_thread() is threading.main_thread():  # SIGTERM ends like Ctrl-C
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        return command[args.command](args)
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
        hint = (" (`decoderlm train --resume DIR` finishes or continues a run from its "
                "newest checkpoint)" if args.command == "train" else "")
        print(f"decoderlm: interrupted{hint}", file=sys.stderr)
        return 130


def _interrupt(signum, frame):
    raise KeyboardInterrupt
