"""`decoderlm sample`: print text sampled from a trained model, prompt by prompt."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Annotated

from ..arguments import Fields, NonNegativeInt, PositiveInt
from ..errors import UserError
from ..files import read_text
from ..options import Decoding, ModelSource
from ..tokenizers import CharTokenizer, Tokenizer
from .generate import stream_text
from .loading import load_for_decoding
from .params import from_flags

__all__ = ["sample", "read_prompts"]


def sample(
    source: Annotated[ModelSource, Fields(ModelSource)] = ModelSource(),
    prompt: list[str] | None = None,
    prompt_file: str | None = None,
    num_samples: PositiveInt = 1,
    stop: list[str] | None = None,
    max_new_tokens: NonNegativeInt = 500,
    temperature: float = 1.0,
    top_k: PositiveInt | None = None,
    top_p: float | None = None,
    seed: NonNegativeInt | None = None,
    block_size: PositiveInt | None = None,
    only_new: bool = False,
    ignore_eos: bool = False,
    decoding: Annotated[Decoding, Fields(Decoding)] = Decoding(),
) -> int:
    """Print text sampled from a trained model.

    Sample a continuation of each prompt and print the prompt followed by it (as
    transformers and nanoGPT do), samples separated by a line `---`; with several prompts
    each sample starts with a line `### prompt I of N` (`, sample J of M` with several
    samples). A prompt's <|endoftext|> is the end-of-text token where the vocabulary has one
    (as nanoGPT's sample.py encodes it); elsewhere it is ordinary text.

    Args:
        source: the model (`ModelSource`: --run, --hf or --gguf; --device, --no-verify, --threads).
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
        block_size: crop the model's context to N positions (at most its block_size;
            DecoderLM.crop_block_size): it then sees at most the last N tokens.
        only_new: print only the continuation, not the prompt (the default prompt is never
            printed).
        ignore_eos: run on past the end-of-text token (a sample otherwise ends there, where
            the vocabulary has one).
        decoding: how the model decodes (`Decoding`: --dtype, --quantize, --compile).

    Returns:
        0, the exit status.

    Raises:
        UserError / MissingFileError: not one of run, hf and gguf, missing or damaged
            files, an empty prompt, a prompt the vocabulary cannot encode (every prompt is
            checked before sampling), a bad sampling setting.
    """
    params = from_flags(  # checked before anything is loaded or printed
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=tuple(stop or ()),
        ignore_eos=ignore_eos,
    )
    model, tokenizer = load_for_decoding(source, decoding)
    if block_size is not None:
        model.crop_block_size(block_size)
    prompts = list(prompt or []) + (read_prompts(prompt_file) if prompt_file else [])
    only_new = only_new or not prompts
    prompts = prompts or [_start_of_document(tokenizer)]
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
            params_i = params if seed is None else replace(params, seed=seed + i)
            _print_stream(stream_text(model, tokenizer, ids, params_i))
    return 0


def read_prompts(path: str) -> list[str]:
    """The prompts of a UTF-8 file, one per line.

    Raises:
        MissingFileError / UserError: the file is missing, a directory, not UTF-8, holds no
            lines, or has an empty line.
    """
    lines = read_text(path, "--prompt-file").splitlines()
    if not lines:
        raise UserError(f"{path} holds no prompts")
    blank = [i + 1 for i, line in enumerate(lines) if not line]
    if blank:
        raise UserError(f"{path}: line {blank[0]} is empty; one prompt per line")
    return lines


def _start_of_document(tokenizer: Tokenizer) -> str:
    """The prompt of a sample without one: <|endoftext|> where the vocabulary has it, else a
    newline (or, for a character vocabulary without one, its first character)."""
    if tokenizer.eot_token is not None:
        return "<|endoftext|>"
    if isinstance(tokenizer, CharTokenizer) and "\n" not in tokenizer.stoi:
        return tokenizer.chars[0]
    return "\n"


def _print_stream(pieces) -> None:
    """Print a sample's text as stream_text produces it, then a newline."""
    for delta, *_ in pieces:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
