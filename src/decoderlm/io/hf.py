"""Hugging Face model directories with their tokenizer: the whole directory `decoderlm export
--format hf` writes (`save_hf`) and `decoderlm sample --hf` reads (`load_hf`): GPT-2
(`decoderlm.io.hf_gpt2`) or the Llama family, Llama, Qwen2 and Mistral (`decoderlm.io.hf_llama`),
told apart by config.json's `architectures` (`hf_model_type`).

`save_hf` writes config.json + model.safetensors, tokenizer.json + tokenizer_config.json (what
AutoTokenizer reads), decoderlm_tokenizer.json (decoderlm's own description) and
generation_config.json (the end-of-text ids).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ..errors import UserError
from ..files import read_json, write_json
from ..model.model import DecoderLM
from ..model.weights import CONFIG_NAME, WEIGHTS_NAME, unwrap_model
from ..tokenizers import GPT2_BPE_DIR, GPT2Tokenizer, Tokenizer, read_hf_tokenizer, read_tokenizer
from ..tokenizers.base import END_OF_TEXT, HF_TOKENIZER_NAME, TOKENIZER_NAME
from .hf_gpt2 import load_gpt2, save_gpt2
from .hf_llama import family_of, load_llama, save_llama
from .targets import export_target

__all__ = ["HF_FILES", "hf_model_type", "hf_tokenizer", "load_hf", "save_hf"]

HF_FILES = (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HF_TOKENIZER_NAME,
    TOKENIZER_NAME,
    "tokenizer_config.json",
    "generation_config.json",
)
"""The names of the files `save_hf` writes (and all it writes)."""

_TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _tokenizer_config(tokenizer: Tokenizer, model_max_length: int) -> dict:
    eot = END_OF_TEXT if tokenizer.eot_token is not None else None
    unk = getattr(tokenizer, "unk_token", None)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eot,
        "eos_token": eot,
        "unk_token": unk,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }


def save_hf(model: DecoderLM, tokenizer: Tokenizer, directory: str | Path, dtype: str = "f32"):
    """Write `model` and `tokenizer` as a Hugging Face directory that AutoModelForCausalLM and
    AutoTokenizer load with no extra arguments, the weights in `dtype` (f32 | f16 | bf16).

    Raises:
        UserError: the model does not export (see `decoderlm.io.targets`), an unknown dtype,
            or a tokenizer whose vocabulary differs from the model's.
    """
    model = unwrap_model(model)
    if dtype not in _TORCH_DTYPES:
        raise UserError(f"a hf export takes dtype f32, f16 or bf16, got {dtype!r}")
    if tokenizer.vocab_size != model.config.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model expects "
            f"vocab_size={model.config.vocab_size}"
        )
    arch = export_target(model.config, "hf")
    model = copy.deepcopy(model).to(_TORCH_DTYPES[dtype])
    directory = Path(directory)
    eot = tokenizer.eot_token
    eos = list(getattr(tokenizer, "eos_token_ids", ())) or eot
    if arch == "gpt2":
        save_gpt2(model, directory, eos_token_id=eot)
    else:
        save_llama(model, directory, eos_token_id=eos)
    config = read_json(directory / "config.json")
    config["dtype"] = config["torch_dtype"] = str(_TORCH_DTYPES[dtype]).removeprefix("torch.")
    write_json(directory / "config.json", config)
    tokenizer.save_pretrained(directory)
    write_json(
        directory / "tokenizer_config.json",
        _tokenizer_config(tokenizer, model.config.max_positions),
    )
    bos = getattr(tokenizer, "bos_token_id", None)
    generation = {"bos_token_id": eot if bos is None else bos, "eos_token_id": eos}
    write_json(directory / "generation_config.json", generation)
    return arch


def hf_model_type(directory: str | Path) -> str:
    """The model type of a Hugging Face directory: "gpt2", or "llama", "qwen2" or "mistral"
    (`decoderlm.io.hf_llama.LLAMA_FAMILY`), read from config.json's `architectures` entry
    (its model_type where it has none).

    Raises:
        MissingFileError: no config.json. UserError: neither entry (a decoderlm run directory
            has none) or an architecture decoderlm does not run (the message names those it
            runs).
    """
    directory = Path(directory)
    config = read_json(directory / "config.json")
    if not isinstance(config, dict) or not (
        config.get("model_type") or config.get("architectures")
    ):
        raise UserError(
            f"{directory}/config.json has no 'model_type', so it is not a Hugging Face "
            f"model directory; for a decoderlm run directory use --run {directory}"
        )
    names = config.get("architectures") or []
    if "GPT2LMHeadModel" in names or (not names and config.get("model_type") == "gpt2"):
        return "gpt2"
    return family_of(config, directory)


def hf_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face directory: decoderlm's own file when the directory has
    one (a `decoderlm export`), else GPT-2's BPE for a GPT-2 model whose tokenizer.json (if
    any) holds GPT-2's vocabulary, else its tokenizer.json through Hugging Face's tokenizers
    library (`decoderlm.tokenizers.read_hf_tokenizer`: with tokenizer_config.json's special
    tokens and chat template and generation_config.json's end-of-text ids).

    Raises:
        MissingFileError / UserError: as `hf_model_type`; a directory with no tokenizer file
            (but a GPT-2 one); a malformed tokenizer file; the tokenizers package missing.
    """
    directory = Path(directory)
    model_type = hf_model_type(directory)
    if (directory / TOKENIZER_NAME).is_file():
        return read_tokenizer(directory)
    if model_type == "gpt2" and _gpt2_vocabulary(directory / HF_TOKENIZER_NAME):
        return GPT2Tokenizer()
    if not (directory / HF_TOKENIZER_NAME).is_file():
        raise UserError(
            f"{directory} has no {HF_TOKENIZER_NAME} (nor decoderlm's {TOKENIZER_NAME}); "
            f"decoderlm reads a model's tokenizer from it"
        )
    return read_hf_tokenizer(directory)


def _gpt2_vocabulary(path: Path) -> bool:
    """Whether a GPT-2 directory's tokenizer.json is GPT-2's own BPE (or there is none)."""
    if not path.is_file():
        return True
    data = read_json(path)
    model = data.get("model") if isinstance(data, dict) else None
    encoder = read_json(GPT2_BPE_DIR / "encoder.json")
    return isinstance(model, dict) and model.get("vocab") == encoder


def load_hf(
    directory: str | Path, map_location: str = "cpu", verify: bool = True
) -> tuple[DecoderLM, Tokenizer]:
    """The model (eval mode) and tokenizer (`hf_tokenizer`) of a Hugging Face directory:
    GPT-2 (`load_gpt2`) or Llama, Qwen2 or Mistral (`load_llama`), as `hf_model_type` tells.
    verify: check the weights against the digest config.json records, where it records one.

    Raises:
        MissingFileError / UserError: missing files, no or another architecture (a decoderlm
            run directory has none), no tokenizer file, options decoderlm has not.
    """
    load = load_gpt2 if hf_model_type(directory) == "gpt2" else load_llama
    model = load(directory, map_location, verify=verify)
    return model, hf_tokenizer(directory)
