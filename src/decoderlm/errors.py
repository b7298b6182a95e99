"""The exception types of a user's mistake.

`UserError` is a mistake in what the user gave: a flag's value, a settings file, a data file, a
text the vocabulary cannot encode. The `decoderlm` command prints its message as one line
(`decoderlm: error: ...`) and exits with status 2; any other exception is a bug and keeps its
traceback. It is a ValueError, so Python callers that catch ValueError keep working.
`MissingFileError` is a file or directory the user named that does not exist (also a
FileNotFoundError).
"""

from __future__ import annotations

__all__ = ["MissingFileError", "UserError", "checked_device", "flag_name", "one_of"]


class UserError(ValueError):
    """A mistake in the user's input; the message names the problem and what to do."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist."""


def flag_name(name: str) -> str:
    """The command-line flag of a parameter or settings field: max_steps -> --max-steps."""
    return "--" + name.rsplit(".", 1)[-1].replace("_", "-")


def one_of(**flags) -> None:
    """Raise UserError unless exactly one of the keyword arguments is not None: "give one of
    --a, --b or --c" when none is, "give only one of --a, --b or --c, not --a and --b" when
    several are ("give only one of --a or --b, not both")."""
    given = [flag_name(name) for name, value in flags.items() if value is not None]
    if len(given) != 1:
        names = _listed([flag_name(name) for name in flags], "or")
        if not given:
            raise UserError(f"give one of {names}")
        extra = "both" if len(given) == len(flags) == 2 else _listed(given, "and")
        raise UserError(f"give only one of {names}, not {extra}")


def _listed(items: list[str], last: str) -> str:
    """["a", "b", "c"] -> "a, b {last} c"."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" {last} {items[-1]}"


def checked_device(text: str | None) -> str | None:
    """`text` if it names a device this machine has (cpu, cuda, cuda:1, mps); None stays None.

    Raises:
        UserError: an unknown device kind, or one this machine does not have.
    """
    if text is None:
        return None
    import torch

    kind = text.split(":")[0]
    available = {
        "cpu": True,
        "cuda": torch.cuda.is_available(),
        "mps": torch.backends.mps.is_available(),
    }
    if kind not in available:
        raise UserError(f"unknown device {text!r}; use cpu, cuda or mps")
    if not available[kind]:
        raise UserError(f"{kind} is not available on this machine; use --device cpu")
    return text
