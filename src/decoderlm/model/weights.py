"""The model directory format: safetensors weights + a JSON config, written atomically.

A model is a directory, as in Hugging Face transformers:

    config.json         {"model": ModelConfig fields, "checksums": {file name: {"sha256":
                        hex digest, "size": bytes}} of the weights file(s) written with it,
                        ...extra entries such as "train"}
    model.safetensors   the state dict; a tied unembedding is stored once (as tok_emb.weight)

Loading checks each weights file against its recorded size, then its sha256 (`verify_file`),
so a truncated or damaged file stops with one line naming it; verify=False (the commands'
--no-verify) skips that, and a directory whose config.json records no checksums loads
unchecked.

A run directory holds one such model, and its resumable checkpoints in
checkpoints/step-NNNNNNNN/ (see `decoderlm.training.checkpoints`).

A run trained with LoRA adapters (`decoderlm.model.lora`) is an adapter directory instead: its
config.json has a "lora" entry and an "init_from" entry (the base model's path and sha256),
and adapter.safetensors holds the adapter tensors alone (``<layer>.lora_A`` / ``lora_B``);
`decoderlm.io.load.load_run` (and `decoderlm.load_model`) reads it over its base.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..config import ModelConfig
from ..errors import MissingFileError, UserError
from ..files import atomic_write, read_json, write_json
from .analysis import count_parameters
from .lora import is_lora_key

__all__ = [
    "save_model",
    "save_weights",
    "read_model_dir",
    "load_state",
    "resolve_tied",
    "read_safetensors",
    "normalize_state_dict",
    "unwrap_model",
    "list_checkpoints",
    "file_digest",
    "verify_file",
    "recorded_digest",
    "CHECKSUMS_KEY",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "CHECKPOINTS_DIR",
    "ADAPTER_NAME",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CHECKPOINTS_DIR = "checkpoints"
ADAPTER_NAME = "adapter.safetensors"
CHECKSUMS_KEY = "checksums"
_CHUNK = 1 << 20  # bytes hashed at a time
_STEP_PREFIX = "step-"
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / DataParallel and torch.compile
_PAIR = ("tok_emb.weight", "lm_head.weight")  # the token embedding and the unembedding
VERIFY_HINT = "copy it again, or skip this check with --no-verify (Python: verify=False)"


def file_digest(path: str | Path) -> dict[str, Any]:
    """{"sha256": hex digest, "size": bytes} of a file, read in 1 MiB chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"sha256": digest.hexdigest(), "size": size}


def recorded_digest(config: Any, name: str, source: str | Path) -> dict[str, Any] | None:
    """The {"sha256", "size"} that a config.json dict records for file `name`, or None when it
    records none (a directory written without checksums).

    Raises:
        UserError: the "checksums" entry is malformed (`source` names the config file).
    """
    table = config.get(CHECKSUMS_KEY) if isinstance(config, dict) else None
    if table is None:
        return None
    entry = table.get(name) if isinstance(table, dict) else None
    if entry is None and isinstance(table, dict):
        return None
    ok = (
        isinstance(entry, dict)
        and isinstance(entry.get("sha256"), str)
        and isinstance(entry.get("size"), int)
    )
    if not ok:
        raise UserError(
            f"{source}: the {CHECKSUMS_KEY!r} entry is malformed (expected {{file name: "
            f"{{'sha256': hex digest, 'size': bytes}}}}); fix or delete it"
        )
    return entry


def verify_file(path: str | Path, recorded: dict[str, Any] | None) -> None:
    """Check a file against its recorded {"sha256", "size"} (None: nothing recorded, no
    check): its size first (a truncated file is found without reading it), then its sha256.

    Raises:
        UserError: the size or the digest differs; the message names the file, both sizes or
            both digests, and the skip flag.
    """
    if recorded is None:
        return
    path = Path(path)
    skip = VERIFY_HINT
    size = path.stat().st_size
    if size != recorded["size"]:
        raise UserError(
            f"{path} is {size:,} bytes but config.json records {recorded['size']:,} "
            f"(truncated, incompletely copied or replaced); {skip}"
        )
    actual = file_digest(path)["sha256"]
    if actual != recorded["sha256"]:
        raise UserError(
            f"{path} has sha256 {actual} but config.json records {recorded['sha256']} "
            f"(damaged or replaced); {skip}"
        )


def normalize_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the leading wrapper prefixes that DDP ("module.") and torch.compile
    ("_orig_mod.") put before every key, in any order; a prefix inside a key is kept."""
    out = {}
    for key, value in state.items():
        while key.startswith(_WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside torch.compile / DDP / DataParallel wrappers (any nesting)."""
    while hasattr(model, "_orig_mod") or hasattr(model, "module"):
        model = getattr(model, "_orig_mod", None) or model.module
    return model


def save_model(
    model: torch.nn.Module, directory: str | Path, extra_config: dict[str, Any] | None = None
) -> None:
    """Write `model` (a DecoderLM, possibly wrapped by DDP or torch.compile) to `directory`.

    Weights go to model.safetensors (float tensors as they are, keys without wrapper
    prefixes, the tied unembedding left out), the ModelConfig to config.json["model"], the
    file's sha256 and size to config.json["checksums"], and `extra_config` entries beside
    them. Each file is written atomically, config.json last.
    """
    model = unwrap_model(model)
    save_weights(model.state_dict(), model.config, directory, extra_config)


def save_weights(
    state: dict[str, torch.Tensor],
    config: ModelConfig,
    directory: str | Path,
    extra_config: dict[str, Any] | None = None,
) -> None:
    """Write a model state dict (any device, wrapper prefixes allowed) and its ModelConfig to
    `directory` as model.safetensors + config.json, each atomically (see `save_model`).

    A state dict holding LoRA adapter tensors is written as an adapter directory:
    adapter.safetensors with those tensors alone (the base weights stay where
    extra_config["init_from"] says), and extra_config must carry the "lora" entry.

    config.json["checksums"] records the weights file's {"sha256", "size"} (hashed once,
    in chunks, right after writing, while the file is in the OS cache), merged with the
    entries that extra_config["checksums"] brings (a checkpoint's trainer state).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = normalize_state_dict(state)
    adapters = {k: v.detach().contiguous().cpu() for k, v in state.items() if is_lora_key(k)}
    if adapters:
        if not (extra_config or {}).get("lora") or not extra_config.get("init_from"):
            raise UserError(
                "a model with LoRA adapters is saved as adapters over its base model; "
                "pass extra_config with its 'lora' and 'init_from' entries, or merge it first"
            )
        atomic_write(directory / ADAPTER_NAME, lambda tmp: save_file(adapters, tmp))
        _write_config(directory, config, extra_config, ADAPTER_NAME)
        return
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    atomic_write(directory / WEIGHTS_NAME, lambda tmp: save_file(state, tmp))
    _write_config(directory, config, extra_config, WEIGHTS_NAME)


def _write_config(directory: Path, config: ModelConfig, extra: dict | None, weights: str):
    """config.json: the model entry, the checksums of `weights` (and extra's), extra's rest."""
    extra = dict(extra or {})
    checksums = {**extra.pop(CHECKSUMS_KEY, {}), weights: file_digest(directory / weights)}
    data = {"model": config.to_dict(), CHECKSUMS_KEY: checksums, **extra}
    write_json(directory / CONFIG_NAME, data)


def read_model_dir(
    directory: str | Path, map_location: str = "cpu", verify: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The ModelConfig and the weights of a directory written by `save_model`.

    With verify, model.safetensors is checked against config.json's recorded size and
    sha256 first (`verify_file`; the hashing pass leaves the file in the OS cache, where the
    memory-mapped load then reads it); nothing recorded: no check. The number of parameters
    in the file is checked against the config before anything is built, so a damaged config
    cannot allocate a huge model.

    Returns:
        (config, state dict with our key names; a tied unembedding may be absent).

    Raises:
        FileNotFoundError: the directory, config.json or model.safetensors is missing.
        UserError: `directory` is a file, config.json has no valid "model" entry, the
            weights file's size or
            sha256 differs from the recorded one, or the file's parameter count differs from
            the config's.
    """
    directory = Path(directory)
    if directory.is_file():
        hint = f"; for a GGUF file use --gguf {directory}" if directory.suffix == ".gguf" else ""
        raise UserError(f"{directory} is a file, not a model or run directory{hint}")
    if not directory.is_dir():
        raise MissingFileError(f"checkpoint directory {directory} not found (or not a directory)")
    if not (directory / CONFIG_NAME).exists() and list_checkpoints(directory):
        raise MissingFileError(
            f"{directory} holds checkpoints but no final model (the run "
            f"stopped early); use --run {list_checkpoints(directory)[-1]}, "
            f"or finish it with `decoderlm train --resume {directory}`"
        )
    config = read_json(directory / CONFIG_NAME)
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise UserError(
            f"{directory / CONFIG_NAME} has no 'model' entry; is this a decoderlm run directory?"
        )
    model_config = ModelConfig.from_dict(config["model"])
    weights = directory / WEIGHTS_NAME
    if not weights.is_file() and (directory / ADAPTER_NAME).is_file():
        raise UserError(
            f"{directory} holds LoRA adapters over a base model, not a whole model; load it "
            f"with decoderlm.load_model (as the decoderlm commands do), or "
            f"write a model directory with `decoderlm merge --run {directory} --out DIR`"
        )
    if not weights.is_file():
        raise MissingFileError(f"{weights} not found")
    if verify:
        verify_file(weights, recorded_digest(config, WEIGHTS_NAME, directory / CONFIG_NAME))
    state = normalize_state_dict(read_safetensors(weights, map_location))
    pair = [state[k] for k in _PAIR if k in state]
    in_file = sum(t.numel() for k, t in state.items() if k not in _PAIR)
    if pair:  # one matrix when tied, two when not, whether the file holds one or both
        in_file += pair[0].numel() * (1 if model_config.tie_embeddings else 2)
    expected_total = count_parameters(model_config)["total"]
    if in_file != expected_total:
        raise UserError(
            f"{weights} holds {in_file:,} parameters but config.json describes a "
            f"model with {expected_total:,}; the two files do not belong together"
        )
    return model_config, state


def read_safetensors(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a damaged file is a UserError naming it."""
    try:
        return load_file(str(path), device=device)
    except Exception as e:  # safetensors raises its own error type for a damaged file
        raise UserError(f"{path} is not a readable safetensors file ({e})") from None


def resolve_tied(
    state: dict, tied: bool, source, prefix: str = "", file_keys: dict | None = None
) -> None:
    """Make `state` (changed in place) hold both the token embedding and the unembedding, by
    the rule for tied weights: one of the two alone stands for both (tied or not); both in a
    tied model must be equal bitwise (same shape, dtype and values), and then are one tensor.

    Args:
        state: a state dict; its keys prefix + "tok_emb.weight" and prefix + "lm_head.weight".
        tied: whether the model that will load it ties them (config.tie_embeddings).
        source: names the file in messages.
        prefix: of both keys (load_state_dict's prefix).
        file_keys: our key -> the file's own name for it, used in messages (e.g. GPT-2's
            "transformer.wte.weight").

    Raises:
        UserError: tied, and the two tensors differ; the message names both keys and the
            largest absolute difference, and how to load them untied.
    """
    emb_key, head_key = (prefix + key for key in _PAIR)
    emb, head = state.get(emb_key), state.get(head_key)
    if emb is None or head is None:
        if emb is not None or head is not None:
            state[emb_key] = state[head_key] = emb if emb is not None else head
        return
    if not tied or emb is head:
        return
    if emb.shape == head.shape and emb.dtype == head.dtype and torch.equal(emb, head):
        state[head_key] = emb
        return
    names = [(file_keys or {}).get(k[len(prefix) :], k) for k in (emb_key, head_key)]
    if emb.shape == head.shape:
        diff = f"max abs difference {(emb.double() - head.double()).abs().max().item():.6g}"
        if emb.dtype != head.dtype:
            diff += f", dtypes {emb.dtype} and {head.dtype}"
    else:
        diff = f"shapes {tuple(emb.shape)} and {tuple(head.shape)}"
    raise UserError(
        f"{source} holds two different matrices {names[0]} and {names[1]} ({diff}) but the "
        f"model ties them (one matrix for both); loading would drop one. Load them untied "
        f"with tie_embeddings=False (DecoderLM.from_pretrained or decoderlm.load_gpt2), "
        f"or set tie_embeddings (GPT-2: tie_word_embeddings) to false in config.json"
    )


def load_state(
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    source,
    file_keys: dict | None = None,
    described_by: str = "config.json",
    owned: bool = False,
) -> torch.nn.Module:
    """Load `state` (our key names) into `model` (a DecoderLM), checked key by key and shape
    by shape first; tied or not, the token embedding or the unembedding may stand for both
    (see `resolve_tied`). Returns the model.

    A model whose parameters are on the meta device (`DecoderLM.unfilled`) gets no memory of
    its own first (`torch.nn.Module.load_state_dict(assign=True)`): each tensor converted to
    the parameter's dtype (float32) becomes the parameter, and one already in that dtype
    becomes it as it is where `owned`, else a copy of it; a tied unembedding is then tied
    again. Any other model gets copies of the tensors.

    file_keys: our key -> the file's name for it, for messages.
    described_by: what describes the model, for messages ("config.json"; a GGUF file's
    reader: "its metadata").
    owned: the tensors are this process's own memory, each its own storage, which the model
    may keep. Tensors read by safetensors are a mapping of the file (copy-on-write): kept as
    parameters, they would change when the file is changed in place.

    Raises:
        UserError: the tensors do not match the model (the message lists missing,
            unexpected and mis-shaped tensors, and names `source`), or two different
            matrices for tied weights.
    """
    state = dict(state)
    resolve_tied(state, model.config.tie_embeddings, source, file_keys=file_keys)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if k in state and state[k].shape != expected[k].shape
    ]
    if missing or unexpected or shapes:
        raise UserError(
            f"{source} does not match {described_by}: missing {missing}, "
            f"unexpected {unexpected}, shape mismatches {shapes}"
        )
    if any(p.is_meta for p in model.parameters()):
        _assign(model, state, expected, owned)
    else:
        model.load_state_dict(state)
    return model


def _assign(model: torch.nn.Module, state: dict, expected: dict, owned: bool) -> None:
    """Make the tensors of `state` (checked against `expected`, the model's state dict) the
    parameters and persistent buffers of `model`, whose own are on the meta device: converted
    or copied as `load_state` says."""
    own: dict[int, torch.Tensor] = {}  # id -> the tensor as assigned (a tied pair once)
    for key, tensor in state.items():
        if id(tensor) not in own:
            fitted = tensor.to(expected[key].dtype).contiguous()
            whole = fitted.untyped_storage().nbytes() == fitted.numel() * fitted.element_size()
            if fitted is tensor and not (owned and whole):
                fitted = fitted.clone()  # a file's mapping, or part of a larger tensor
            own[id(tensor)] = fitted
        state[key] = own[id(tensor)]
    model.load_state_dict(state, assign=True)
    if model.config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first (temporary directories excluded)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(_STEP_PREFIX) and p.name[len(_STEP_PREFIX) :].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name[len(_STEP_PREFIX) :]))
