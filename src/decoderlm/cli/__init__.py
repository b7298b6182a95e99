"""The `decoderlm` command: train | prepare | eval | sample | chat | serve | presets | params |
inspect | merge | export.

Each command is a function of the subsystem that does the work (`COMMANDS`, imported only
when its command runs); its signature and docstring are the command's flags and --help (see
`decoderlm.cli.flags`). Flags are written with dashes (`--max-steps`), booleans as `--flag`,
`--flag true` or `--flag false`, an unset optional value as `none`, and a list flag is repeated
for each value; `--config FILE` reads them from a YAML, JSON or TOML file, and the flags given
override it.

A user's mistake (a bad flag, a `decoderlm.errors.UserError`, an OSError from the file
system) prints one line `decoderlm: error: ...` and exits with status 2; any other exception
is a bug and keeps its traceback (exit status 1).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import signal
import sys
import threading
from pathlib import Path

from .. import __version__
from ..config import ModelConfig
from ..errors import UserError
from ..presets import PRESETS
from .flags import Command, FlagError, Parser, command_flags

__all__ = ["COMMANDS", "command", "function", "main", "parse"]

COMMANDS = {
    "train": "decoderlm.training.run:run_experiment",
    "prepare": "decoderlm.data.prepare:prepare",
    "eval": "decoderlm.evaluate:print_report",
    "sample": "decoderlm.generation.sample:sample",
    "chat": "decoderlm.generation.chat:chat",
    "serve": "decoderlm.serve.app:serve",
    "presets": "decoderlm.counts:list_presets",
    "params": "decoderlm.counts:params",
    "inspect": "decoderlm.lens.report:inspect",
    "merge": "decoderlm.finetune.merge:merge",
    "export": "decoderlm.io.export:export",
}
RENAMED = {"export": {"--dtype": "--outtype"}}  # command -> {flag: its name now}
METAVARS = {  # the flags shown with a word of what they take, not their name in capitals
    "run": "DIR",
    "hf": "DIR",
    "gguf": "FILE",
    "out": "DIR",
    "resume": "DIR",
    "init_from": "SRC",
    "data": "PATH",
    "dataset": "NAME",
    "prompt_file": "FILE",
    "chat_template": "FILE",
    "model_config": "FILE",
    "text_file": "FILE",
    "stop": "TEXT",
    "text": "TEXT",
    "corrupt": "TEXT",
}


def function(name: str):
    """The function of command `name` (its module imported now)."""
    module, attribute = COMMANDS[name].split(":")
    return getattr(importlib.import_module(module), attribute)


def command(name: str) -> Command:
    """The parser of command `name`, from its function."""
    shown = {}
    if name == "train":  # the model flags show the model `decoderlm train` trains
        model = ModelConfig.from_dict(PRESETS["default"].model).to_dict()
        note = "Shown: the 'default' preset's (with no --preset and no --config)."
        shown["model_overrides"] = ({**model, "vocab_size": "the tokenizer's"}, note)
    metavars = METAVARS
    if name in ("inspect", "export"):  # an HTML file; a directory or a GGUF file
        metavars = {**METAVARS, "out": "FILE" if name == "inspect" else "PATH"}
    return command_flags(f"decoderlm {name}", function(name), metavars, shown)


def _summary(name: str) -> str:
    """The first line of a command's docstring, read from the source of its module without
    importing it (`decoderlm --help` imports no torch)."""
    module, attribute = COMMANDS[name].split(":")
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8"))
    node = next(n for n in tree.body if getattr(n, "name", None) == attribute)
    return ast.get_docstring(node).splitlines()[0].rstrip(".")


def parse(argv: list[str]) -> tuple[str, dict]:
    """(command, the keyword arguments of its function) of a command line.

    Raises:
        SystemExit: --help or --version (status 0; printed).
        FlagError: a bad flag or value, no command or an unknown one.
        UserError / MissingFileError: an unusable settings file.
    """
    if argv and argv[0] in COMMANDS:
        return argv[0], command(argv[0]).parse(argv[1:])
    root = Parser(
        prog="decoderlm",
        description="Train, sample and inspect decoder-only language models.",
        allow_abbrev=False,
    )
    root.add_argument("--version", action="version", version=f"decoderlm {__version__}")
    commands = root.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name in COMMANDS:
        commands.add_parser(name, help=_summary(name), add_help=False)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        raise FlagError(f"unknown flag {argv[0]!r}; give a command first (decoderlm COMMAND ...)")
    root.parse_args(argv)  # exits (--help, --version) or raises: the command is not known
    raise FlagError(f"unknown command {argv[0]!r}")


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); returns the exit status: 0 (also
    when the reader of stdout closes it early), 2 a user's mistake, 130 interrupted. Any
    other exception, a bug, is raised with its traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        name, kwargs = parse(argv)
    except SystemExit as exit_:  # --help, --version
        return exit_.code
    except FlagError as e:
        hint = f"decoderlm {argv[0]} --help" if argv and argv[0] in COMMANDS else "decoderlm --help"
        print(f"decoderlm: error: {e}{_renamed(argv)} (see `{hint}`)", file=sys.stderr)
        return 2
    except (UserError, OSError) as e:
        print(f"decoderlm: error: {e}", file=sys.stderr)
        return 2
    if kwargs.get("nproc_per_node") and "LOCAL_RANK" not in os.environ:  # not a worker yet:
        from ..training.launch import launch  # the workers run this same command line

        return launch(argv, kwargs["nproc_per_node"])
    return _run(name, kwargs)


def _renamed(argv: list[str]) -> str:
    """ "; --OLD is now --NEW" for each renamed flag of RENAMED that argv gives, else ""."""
    renamed = RENAMED.get(argv[0], {}) if argv else {}
    given = {a.split("=")[0] for a in argv[1:]}
    return "".join(f"; {old} is now {new}" for old, new in renamed.items() if old in given)


def _run(name: str, kwargs: dict) -> int:
    """Call command `name`'s function; user errors become one line on stderr and status 2."""
    rank = int(os.environ.get("RANK", "0"))  # under torchrun, rank 0 reports user errors
    if threading.current_thread() is threading.main_thread():  # SIGTERM ends like Ctrl-C
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        status = function(name)(**kwargs)
    except BrokenPipeError:  # e.g. `decoderlm sample ... | head`: the reader has what it
        # wanted, so stop quietly and successfully; stdout goes to /dev/null so that the
        # interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (UserError, OSError) as e:
        if rank == 0 or not isinstance(e, UserError | FileNotFoundError):
            print(f"decoderlm: error: {f'[rank {rank}] ' if rank else ''}{e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = (
            " (`decoderlm train --resume DIR` finishes or continues a run from its "
            "newest checkpoint)"
            if name == "train"
            else ""
        )
        print(f"decoderlm: interrupted{hint}", file=sys.stderr)
        return 130
    return status if type(status) is int else 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt
