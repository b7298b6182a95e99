"""The model a command decodes, scores or inspects, from its option groups: loaded from a
`ModelSource` (its --threads set) and made ready at a `Precision` (`decoderlm sample`,
`serve`, `eval`, `inspect`)."""

from __future__ import annotations

import torch

from ..io.load import load_from_flags
from ..model.model import DecoderLM
from ..options import Decoding, ModelSource, Precision
from ..tokenizers import Tokenizer
from .precision import prepare_for_decoding

__all__ = ["load_for_decoding"]


def load_for_decoding(
    source: ModelSource, precision: Precision | None = None
) -> tuple[DecoderLM, Tokenizer]:
    """The model (eval mode) and tokenizer of `source`, the model changed in place to decode at
    `precision` (`prepare_for_decoding`; None or Precision(): float32 as loaded). A `Decoding`
    with compile=True keeps bfloat16 matrices plain for the compiled step.

    Raises:
        UserError / MissingFileError: not exactly one of run, hf and gguf, an unusable
            device, missing or damaged files, not enough memory (see
            `decoderlm.io.load.load_from_flags`); a precision the model or the
            machine cannot decode in (see `prepare_for_decoding`).
    """
    s, precision = source, precision or Precision()
    if s.threads is not None:
        torch.set_num_threads(s.threads)  # torch's intra-op threads, for the whole process
    model, tokenizer = load_from_flags(
        run=s.run, hf=s.hf, gguf=s.gguf, device=s.device, verify=not s.no_verify, base=s.base
    )
    compile = isinstance(precision, Decoding) and precision.compile
    prepare_for_decoding(model, precision.dtype, precision.quantize, compile)
    return model, tokenizer
