"""The option groups that several commands share, and the one set of number-format names.

`ModelSource` (which model: --run, --hf or --gguf; --base, --device, --no-verify, --threads),
`Precision` (--dtype, --quantize: the number formats a model decodes or is scored in) and `Decoding`
(Precision and --compile) are frozen dataclasses, checked when built. A command takes one as
a parameter `Annotated[ModelSource, Fields(ModelSource)]` (see `decoderlm.arguments.Fields`):
the command line gives each field its flag, helped by the field's docstring, so the flags and
their help are written once, here, for `decoderlm sample`, `serve`, `eval` and `inspect`.

`DtypeName` is the names of the number formats that `train` and `params` take, torch's
(float32, bfloat16, float16) and their short names (f32, bf16, f16 as llama.cpp writes them;
fp32, fp16); `canonical_dtype` gives torch's name of one. `DecodeDtypeName` is those a model
decodes in, which `sample`, `chat`, `serve`, `eval` and `inspect` take (`Precision`).
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal

from .arguments import DecodeDType, Quantize
from .errors import UserError, flag_name

__all__ = [
    "DTYPE_ALIASES",
    "DecodeDtypeName",
    "Decoding",
    "DtypeName",
    "TrainDtypeName",
    "ModelSource",
    "Precision",
    "canonical_dtype",
    "parse_threads",
]

# torch's names of the number formats, then their short names (accepted everywhere, the same)
DTYPE_ALIASES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
DTYPE_ALIASES |= {"fp32": "float32", "fp16": "float16"}
DtypeName = Literal["float32", "bfloat16", "float16", "f32", "bf16", "f16", "fp32", "fp16"]
# decoding's: those of DtypeName that a model decodes in (`Precision`)
DecodeDtypeName = Literal["float32", "bfloat16", "f32", "bf16", "fp32"]
# training's: the above, or "auto" (the device's fast format, `training.loop.resolve_dtype`)
TrainDtypeName = Literal["auto", DtypeName]


def canonical_dtype(name: str) -> str:
    """torch's name of a number format: "bf16" -> "bfloat16", "float32" -> "float32", ...

    Raises:
        UserError: not one of DtypeName.
    """
    if name not in typing.get_args(DtypeName):
        raise UserError(f"dtype must be one of {list(typing.get_args(DtypeName))}, got {name!r}")
    return DTYPE_ALIASES.get(name, name)


def parse_threads(threads: int | str | None, auto: bool = True) -> int | str | None:
    """None, "auto" (where `auto`) or a positive integer (also given as text) up to
    os.cpu_count() (more threads than CPUs only wait for each other): `--threads` of `train`,
    `sample`, `serve`, `eval` and `inspect`.

    Raises:
        UserError: anything else (the message names --threads and what it takes).
    """
    if threads is None or (auto and threads == "auto"):
        return threads
    n = int(threads) if str(threads).isdigit() and not isinstance(threads, bool) else 0
    if n < 1:
        takes = "auto or a positive integer" if auto else "a positive integer"
        raise UserError(f"--threads must be {takes}, got {threads!r}")
    cpus = os.cpu_count() or 1
    if n > cpus:
        more = ", or auto" if auto else ""
        raise UserError(
            f"--threads {n} is more than this machine's {cpus} CPUs; give at most {cpus}{more}"
        )
    return n


@dataclass(frozen=True)
class ModelSource:
    """The model a command loads: exactly one of a run directory, a Hugging Face directory
    and a GGUF file (the loader refuses none or several), the device it goes to, and whether
    its weights are checked.

    Raises:
        UserError: an empty run, hf, gguf or base (the message names its flag).
    """

    ONE_OF: ClassVar[tuple[str, ...]] = ("run", "hf", "gguf")
    """The fields of which one is given: a flag of them replaces a settings file's."""
    run: str | None = None
    """a run directory (give --run, --hf or --gguf)."""
    hf: str | None = None
    """a Hugging Face GPT-2, Llama, Qwen2 or Mistral directory (config.json + safetensors)
    or a Hub model id (owner/name: downloaded into the Hugging Face cache; HF_HUB_OFFLINE=1
    reads the cache only), with its tokenizer (else GPT-2 BPE)."""
    gguf: str | None = None
    """a GGUF file (architecture gpt2, llama or qwen2), e.g. from `decoderlm export` or
    llama.cpp."""
    base: str | None = None
    """the base model of a LoRA run given to --run, in a new place (default: where the run
    records it, relative to the run first)."""
    device: str = "cpu"
    """cpu, cuda, ..."""
    no_verify: bool = False
    """load the weights without checking them against the sizes and sha256 digests that
    config.json records (for huge files)."""
    threads: int | None = None
    """CPU threads torch computes with (at most the machine's CPUs; default torch's, the
    usable cores): fewer than the cores is faster on a machine other programs keep busy."""

    def __post_init__(self) -> None:
        for name in (*self.ONE_OF, "base"):
            if getattr(self, name) == "":
                raise UserError(f"{flag_name(name)} must not be empty")
        object.__setattr__(self, "threads", parse_threads(self.threads, auto=False))

    @property
    def path(self) -> str | None:
        """The run directory, Hugging Face directory or GGUF file given (the first of them;
        None without one)."""
        return self.run or self.hf or self.gguf


@dataclass(frozen=True)
class Precision:
    """The number formats a model decodes or is scored in
    (`generation.precision.prepare_for_decoding`); dtype is stored as torch's name.

    Raises:
        UserError: a dtype that is not one of DecodeDtypeName.
    """

    dtype: DecodeDtypeName | None = None
    """the weights' and activations' dtype while decoding: float32 (f32, fp32) or bfloat16
    (bf16, half the bytes per token); by default (or none) float32, and bfloat16 with
    --quantize."""
    quantize: Quantize | None = None
    """int8: weight-only int8 block matrices and unembedding, a scale per row (CPU; input
    widths multiples of 16); w8a8: the same int8 weights multiplied with activations
    quantised to 8 bits (oneDNN's integer products, x86 CPUs); none (the default): the
    weights in --dtype."""

    def __post_init__(self) -> None:
        if self.dtype is None:
            return
        dtype = canonical_dtype(self.dtype)
        decoded = typing.get_args(DecodeDType)
        if dtype not in decoded:
            raise UserError(
                f"--dtype {self.dtype}: a model decodes in {' or '.join(decoded)} (f32, bf16), "
                f"not {dtype}; use --dtype bfloat16 for half the bytes a token"
            )
        object.__setattr__(self, "dtype", dtype)


@dataclass(frozen=True)
class Decoding(Precision):
    """The number formats a model decodes in, and whether its decoding step is compiled."""

    compile: bool = False
    """decode with torch.compile: faster per token after a one-time compile (needs a C++
    compiler on the CPU)."""
