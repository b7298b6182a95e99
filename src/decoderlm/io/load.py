"""Loading a model and its tokenizer from any source: the one loader every command and
`decoderlm.load_model` / `decoderlm.load_tokenizer` use.

A source is one of

    run     a decoderlm run or model directory (config.json with a "model" entry and
            model.safetensors, `decoderlm.model.weights`), or an adapter directory (a LoRA run:
            its base model loaded and the adapters applied, `decoderlm.io.adapters`)
    hf      a Hugging Face GPT-2, Llama, Qwen2 or Mistral directory (config.json with a
            "model_type", `decoderlm.io.hf`); `load_from_flags(hf=)` also takes a Hub model
            id, downloaded into the Hugging Face cache (`decoderlm.io.hub`)
    gguf    a GGUF file (`decoderlm.io.gguf`)

`load_model(source)`, `load_tokenizer(source)` and `load_model_and_tokenizer(source)` tell them
apart by what the path is (`source_kind`); `load_from_flags(run=, hf=, gguf=)` takes one named
kind, as the commands' --run / --hf / --gguf do. Every model they give has `eos_token_id` set
to its tokenizer's end-of-text id (`DecoderLM.set_end_of_text`: with the tokenizer loaded
beside it, checked to fit its vocabulary; for a run read alone, from its saved tokenizer file,
as `DecoderLM.from_pretrained` does).
`load_source` is what `decoderlm train --init-from SRC` starts from: any of those sources,
with a record of it (path, kind, sha256 of its weights) for the new run's config.json.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..allocator import give_back_freed_memory
from ..errors import UserError, checked_device, one_of
from ..files import read_json
from ..model.analysis import out_of_memory_as_user_error
from ..model.model import DecoderLM
from ..model.weights import ADAPTER_NAME, CONFIG_NAME, WEIGHTS_NAME, recorded_digest
from ..tokenizers import Tokenizer, read_end_of_text_id, read_tokenizer
from .adapters import (
    BaseModelError,
    adapted_model,
    adapter_config,
    checked_adapter_dir,
    is_adapter_dir,
)
from .gguf import load_gguf, load_gguf_tokenizer
from .hf import hf_tokenizer, load_hf
from .hf_weights import HF_WEIGHT_FILES, hf_weight_files
from .hub import hub_directory, is_hub_id

__all__ = [
    "Source",
    "check_flag_path",
    "load_from_flags",
    "load_model",
    "load_model_and_tokenizer",
    "load_run",
    "load_source",
    "load_tokenizer",
    "source_kind",
    "weights_sha256",
]

_NOT_A_MODEL = (
    "expected a decoderlm run directory (config.json with a 'model' entry and "
    "model.safetensors), a Hugging Face directory (config.json and model.safetensors, its "
    "index and shards, or pytorch_model.bin) or a GGUF file"
)


def source_kind(source: str | Path) -> str:
    """What a model source is: "gguf" (a file, or a missing path ending in .gguf), "hf" (a
    directory whose config.json has a "model_type" and no "model" entry) or "run" (any other
    path, whose loader says what is missing)."""
    path = Path(source)
    if path.is_file() or (not path.exists() and path.suffix == ".gguf"):
        return "gguf"
    config = read_json(path / CONFIG_NAME) if (path / CONFIG_NAME).is_file() else None
    if isinstance(config, dict) and "model" not in config and "model_type" in config:
        return "hf"
    return "run"


def _paired(model: DecoderLM, tokenizer: Tokenizer, source) -> tuple[DecoderLM, Tokenizer]:
    """(model, tokenizer) once they are checked to belong together, the model's
    `eos_token_id` set to the tokenizer's end-of-text id.

    Raises:
        UserError: the tokenizer has another vocabulary size than the model.
    """
    if tokenizer.vocab_size != model.config.vocab_size:
        raise UserError(
            f"the tokenizer of {source} has {tokenizer.vocab_size} tokens but the "
            f"model expects vocab_size={model.config.vocab_size}"
        )
    model.set_end_of_text(getattr(tokenizer, "eos_token_ids", None) or tokenizer.eot_token)
    return model, tokenizer


def load_run(
    directory: str | Path,
    map_location: str = "cpu",
    merge: bool = True,
    verify: bool = True,
    base: str | Path | None = None,
) -> DecoderLM:
    """Load a run or model directory in eval mode; an adapter directory is loaded over its
    base. Its `eos_token_id` is the end-of-text id of the directory's tokenizer file.

    Args:
        directory: a model directory (`DecoderLM.from_pretrained`) or an adapter directory
            (a LoRA run or checkpoint: config.json with "lora" and "init_from" entries and
            adapter.safetensors).
        map_location: the device to load onto.
        merge: fold the adapters into the weights (a plain DecoderLM whose logits equal the
            adapted model's); False keeps `LoRALinear` layers (for resuming training).
        verify: check model.safetensors (or adapter.safetensors, and the base's weights)
            against the size and sha256 that config.json records; False skips it. A
            directory that records none loads unchecked.
        base: an adapter directory's base model in a new place (--base), instead of the
            one config.json records (`decoderlm.io.adapters.checked_adapter_dir`).

    Raises:
        MissingFileError / UserError: missing or damaged files (a weights file whose size
            or sha256 differs from the recorded one: the message names it and both values);
            the base model is missing or its weights changed since the adapters were trained
            (sha256 differs).
    """
    directory = Path(directory)
    if not is_adapter_dir(directory) and base is not None:
        raise UserError(
            f"--base gives the base model of a LoRA run; {directory} is not one (no "
            f"{ADAPTER_NAME}); drop --base"
        )
    if not is_adapter_dir(directory):
        return DecoderLM.from_pretrained(directory, map_location, verify=verify)
    config, base_info, lora = checked_adapter_dir(directory, verify, base)
    source = load_source(base_info["path"], map_location, verify)
    if source.info["sha256"] != base_info["sha256"] and base is not None:
        raise BaseModelError(
            f"--base {base} is not the base model {directory} was trained from (its weights' "
            f"sha256 differs from the recorded {base_info['sha256']}); give that one"
        )
    if source.info["sha256"] != base_info["sha256"]:
        raise BaseModelError(
            f"the base model {base_info['path']} changed since {directory} was trained from it "
            f"(its weights' sha256 differs); restore the original weights"
        )
    model = adapted_model(directory, config, lora, source.model, merge, base_info["path"])
    model.set_end_of_text(read_end_of_text_id(directory))
    return model.to(map_location).eval()


def _load(kind: str, source, map_location: str, merge: bool, verify: bool, base=None):
    """(model, tokenizer) of a source of `kind` ("run" | "hf" | "gguf"), paired; base: a
    LoRA run's base in a new place (`load_run`)."""
    if kind == "hf":
        model, tokenizer = load_hf(source, map_location, verify=verify)
    elif kind == "gguf":
        model, tokenizer = load_gguf(source, map_location, verify=verify)
    else:
        model = load_run(source, map_location, merge, verify=verify, base=base)
        tokenizer = read_tokenizer(source)
    give_back_freed_memory()  # the weights' forms before the model's (dequantised, converted)
    return _paired(model, tokenizer, source)


def load_model_and_tokenizer(
    source: str | Path,
    map_location: str = "cpu",
    *,
    merge: bool = True,
    verify: bool = True,
    base: str | Path | None = None,
) -> tuple[DecoderLM, Tokenizer]:
    """The model (eval mode) and tokenizer of `source`: a run, adapter, Hugging Face or GGUF
    source (see the module docstring and `source_kind`). The model's `eos_token_id` is the
    tokenizer's `eot_token` (None without one), where `generate` stops by default.

    Args:
        source: the run or Hugging Face directory, or the GGUF file.
        map_location: the device to load onto.
        merge: an adapter directory's adapters folded into the weights (`load_run`).
        verify: check the weights against the digests their files record (config.json's
            "checksums" entry; a GGUF file's "decoderlm.sha256" key); a source
            that records none loads unchecked.
        base: a LoRA run's base model in a new place (`load_run`).

    Raises:
        MissingFileError / UserError: missing or damaged files, a tokenizer whose vocabulary
            does not fit the model, options decoderlm has not (from the format's loader).
    """
    return _load(source_kind(source), source, map_location, merge, verify, base)


def load_model(
    source: str | Path,
    map_location: str = "cpu",
    merge: bool = True,
    verify: bool = True,
    base: str | Path | None = None,
) -> DecoderLM:
    """The model (eval mode) of `source`, as `load_model_and_tokenizer` gives it; a run's
    tokenizer is not built (its end-of-text id is read from the saved file). base: a LoRA
    run's base model in a new place (`load_run`).

    Raises:
        MissingFileError / UserError: as `load_model_and_tokenizer`.
    """
    kind = source_kind(source)
    if kind == "run":
        return load_run(source, map_location, merge, verify, base)
    return _load(kind, source, map_location, merge, verify)[0]


def load_tokenizer(source: str | Path) -> Tokenizer:
    """The tokenizer of `source` (see `load_model_and_tokenizer`) without its model: a run's
    saved tokenizer (`decoderlm.tokenizers.read_tokenizer`), a Hugging Face directory's
    (`decoderlm.io.hf.hf_tokenizer`) or a GGUF file's (`decoderlm.io.gguf.load_gguf_tokenizer`).

    Raises:
        MissingFileError / UserError: no tokenizer file, or a malformed one.
    """
    kind = source_kind(source)
    if kind == "hf":
        return hf_tokenizer(source)
    if kind == "gguf":
        return load_gguf_tokenizer(source)
    return read_tokenizer(source)


def load_from_flags(
    *,
    run: str | Path | None = None,
    hf: str | Path | None = None,
    gguf: str | Path | None = None,
    device: str | None = "cpu",
    verify: bool = True,
    base: str | Path | None = None,
) -> tuple[DecoderLM, Tokenizer]:
    """The model (eval mode) and tokenizer of exactly one of `run` (a decoderlm run, model or
    adapter directory), `hf` (a Hugging Face GPT-2, Llama, Qwen2 or Mistral directory, or a
    Hub model id such as "HuggingFaceTB/SmolLM2-135M": `decoderlm.io.hub.hub_directory`) or
    `gguf` (a GGUF file), as the commands' --run / --hf / --gguf name them; each is read as
    that kind only.
    device: where to load it (checked first). verify, base: as in `load_model_and_tokenizer`
    (base is refused with --hf or --gguf).

    Raises:
        UserError: none or several given, an unusable device, not enough memory to load the
            model (one line with the estimate), a Hub id that cannot be had (offline and not
            cached, say); MissingFileError / UserError of the loaders.
    """
    one_of(run=run, hf=hf, gguf=gguf)
    if base is not None and run is None:
        raise UserError("--base gives the base model of a LoRA run; use it with --run")
    device = checked_device(device)
    given = (("run", run), ("hf", hf), ("gguf", gguf))
    kind, source = next((k, v) for k, v in given if v is not None)
    if kind == "hf":
        source = hub_directory(source)
    check_flag_path(kind, Path(source))
    flags = f"--run {run}" if run else ""
    with out_of_memory_as_user_error(f"load the model of {source}", params_flags=flags):
        return _load(kind, source, device, True, verify, base)


def check_flag_path(kind: str, path: Path) -> None:
    """UserError, one line naming the flag to use, for a path that flag `--{kind}` cannot take
    although another could: a folder inside a run directory (its checkpoints/, say) given to
    --run, or a file given to --hf. Paths that do not exist are left to the loaders.

    Raises:
        UserError: as above.
    """
    if kind == "hf" and path.is_file():
        hint = f"give --gguf {path}" if path.suffix == ".gguf" else "give its directory"
        raise UserError(f"--hf {path} is a file, not a Hugging Face directory; {hint}")
    if kind != "run" or not path.is_dir() or (path / CONFIG_NAME).exists():
        return
    above = next((p for p in path.parents if (p / CONFIG_NAME).is_file()), None)
    if above is None and path.name == "checkpoints":
        above = path.parent
    if above is not None:
        raise UserError(
            f"--run {path} is a folder inside the run directory {above}, not a model "
            f"directory; give --run {above}"
        )


@dataclass
class Source:
    """A model to start from: the DecoderLM (eval mode, adapters merged), its tokenizer, and
    info = {"path": the resolved path (a Hub id's snapshot in the Hugging Face cache), "kind":
    "decoderlm" | "hf" | "gguf", "sha256": of its weights, and "hub_id" for a Hub id}."""

    model: DecoderLM
    tokenizer: Tokenizer
    info: dict


def _sha256_of(paths: list[Path], extra: str = "") -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    digest.update(extra.encode())
    return digest.hexdigest()


def weights_sha256(directory: str | Path) -> str:
    """sha256 of the files that hold a model directory's weights: model.safetensors; an
    adapter directory's adapter.safetensors followed by its base's recorded sha256; a Hugging
    Face directory's weight file (or index and shards).

    Raises:
        MissingFileError: no weight file.
    """
    directory = Path(directory)
    if (directory / WEIGHTS_NAME).is_file():
        return _sha256_of([directory / WEIGHTS_NAME])
    if is_adapter_dir(directory):
        base = adapter_config(directory)[1]
        return _sha256_of([directory / ADAPTER_NAME], base["sha256"])
    return _sha256_of(hf_weight_files(directory))


def _checked_init_source(src: str | Path) -> str:
    """The kind (`source_kind`) of --init-from SRC once it is a model the loader takes.

    Raises:
        UserError: a directory or file that holds no model (the message says what one holds);
            a run directory without its tokenizer.json.
    """
    path = Path(src)
    kind = source_kind(path)
    if path.is_file() and path.suffix != ".gguf":
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":  # the magic every GGUF file starts with
                raise UserError(f"--init-from {src} is not a model: {_NOT_A_MODEL}")
    if kind == "gguf" or not path.exists():
        return kind  # a GGUF file, or a path the loader names as missing
    config = read_json(path / CONFIG_NAME) if (path / CONFIG_NAME).is_file() else None
    if not path.is_dir() or not isinstance(config, dict):
        raise UserError(f"--init-from {src} is not a model: {_NOT_A_MODEL}")
    if kind == "hf" and not any((path / name).is_file() for name in HF_WEIGHT_FILES):
        raise UserError(f"--init-from {src} is not a model: {_NOT_A_MODEL}")
    if kind == "run" and "model" not in config:
        raise UserError(f"--init-from {src} is not a model: {_NOT_A_MODEL}")
    if kind == "run" and not (path / "tokenizer.json").is_file():
        raise UserError(f"{src} has no tokenizer.json; a run directory saves its tokenizer")
    return kind


def load_source(
    src: str | Path, map_location: str = "cpu", verify: bool = True, base: str | Path | None = None
) -> Source:
    """The model, tokenizer and source record of SRC for `decoderlm train --init-from SRC`:
    any source the loader takes (`load_model_and_tokenizer`): a decoderlm run or model
    directory (an adapter directory: merged over its base), a Hugging Face directory of an
    architecture decoderlm runs (GPT-2, Llama, Qwen2, Mistral; its tokenizer as
    `decoderlm.io.hf.hf_tokenizer` reads it) or a GGUF file (dequantized to float32, its own
    vocabulary as the tokenizer). verify: check the weight files against the digests they
    record (`load_model_and_tokenizer`). base: an adapter directory's base model in a new
    place (`load_run`).

    Raises:
        MissingFileError / UserError: SRC is not a model (the message says what one holds),
            its files are damaged or do not belong together, it has no tokenizer.json (a
            decoderlm directory), or the loader refuses it (an architecture or option
            decoderlm does not run: the message names it).
    """
    hub_id = str(src) if is_hub_id(src) else None
    path = src = Path(hub_directory(src))  # a Hub id: its snapshot in the Hugging Face cache
    kind = _checked_init_source(src)
    model, tokenizer = _load(kind, src, map_location, True, verify, base)
    if kind == "gguf":
        sha256 = _sha256_of([path])
    elif kind == "run" and verify and (path / WEIGHTS_NAME).is_file():
        # a digest the load has just checked is the file's: no second pass over a large file
        config = read_json(path / CONFIG_NAME)
        checked = recorded_digest(config, WEIGHTS_NAME, path / CONFIG_NAME)
        sha256 = checked["sha256"] if checked is not None else weights_sha256(path)
    else:
        sha256 = weights_sha256(path)
    info = {"path": str(path.resolve()), "kind": {"run": "decoderlm"}.get(kind, kind)}
    info["sha256"] = sha256
    if hub_id is not None:
        info["hub_id"] = hub_id
    return Source(model, tokenizer, info)
