"""The types of a command's parameters that say more than a Python type: what the command line
checks in a flag's value, and which parameter takes a dataclass's fields.

`NonNegativeInt`, `PositiveInt`, `NotEmptyStr` and `NotEmptyPath` are `typing.Annotated` types
whose `Check` the command line applies to a flag's value (a Python caller gets the plain type);
`Fields` marks a dict parameter whose keys are a dataclass's fields (`decoderlm.cli.flags`
gives each field a flag).
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
    """For `typing.Annotated[dict | None, Fields(cls, section)]` on a command's parameter: the
    dict maps fields of dataclass `cls` (also of its nested dataclass fields) to values; the
    command line gives each field its own flag (--n-layers) and a settings file has them under
    `section`."""

    cls: type
    section: str


NonNegativeInt = Annotated[int, Check("an integer >= 0", lambda v: v >= 0)]
PositiveInt = Annotated[int, Check("an integer > 0", lambda v: v > 0)]
NotEmptyStr = Annotated[str, Check("a non-empty string", lambda v: v != "")]
NotEmptyPath = Annotated[str | Path, Check("a non-empty string", lambda v: str(v) != "")]
# the weights' and activations' dtype while decoding, and the quantisation of its matrices
# (decoderlm.generation.precision)
DecodeDType = Literal["float32", "bfloat16"]
Quantize = Literal["int8", "w8a8"]
