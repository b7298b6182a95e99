"""The types of a command's parameters that say more than a Python type: what the command line
checks in a flag's value, and which parameter takes a dataclass's fields.

`NonNegativeInt`, `PositiveInt`, `NotEmptyStr` and `NotEmptyPath` are `typing.Annotated` types
whose `Check` the command line applies to a flag's value (a Python caller gets the plain type);
`Fields` marks a parameter that takes a dataclass's fields (`decoderlm.cli.flags` gives each
field a flag; `decoderlm.options` holds the groups several commands share).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

__all__ = [
    "Check",
    "DecodeDType",
    "Fields",
    "NonNegativeInt",
    "NotEmptyPath",
    "NotEmptyStr",
    "PositiveInt",
    "Quantize",
]


@dataclass(frozen=True)
class Check:
    """A condition on a value, for `typing.Annotated[T, Check(...)]`: the command line refuses
    a value failing `test`, saying that it expected `words`."""

    words: str
    test: Callable[[Any], bool]


@dataclass(frozen=True)
class Fields:
    """A command's parameter whose flags are the fields of dataclass `cls`: the command line
    gives each field its own flag (--n-layers), and a settings file has them under `section`
    (None: among the command's own settings, its flags among the command's own flags).

    `Annotated[dict | None, Fields(cls, section)]`: the parameter is passed a dict of the
    fields given (also of nested dataclass fields, flattened). `Annotated[cls, Fields(cls)]`
    (a dataclass without nested ones): it is passed `cls(**the fields given)`, or its default
    when none is given.
    """

    cls: type
    section: str | None = None


NonNegativeInt = Annotated[int, Check("an integer >= 0", lambda v: v >= 0)]
PositiveInt = Annotated[int, Check("an integer > 0", lambda v: v > 0)]
NotEmptyStr = Annotated[str, Check("a non-empty string", lambda v: v != "")]
NotEmptyPath = Annotated[str | Path, Check("a non-empty string", lambda v: str(v) != "")]
# the weights' and activations' dtype while decoding (torch's names; `decoderlm.options`
# has the names commands take), and the quantisation of its matrices
# (decoderlm.generation.precision)
DecodeDType = Literal["float32", "bfloat16"]
Quantize = Literal["int8", "w8a8"]
