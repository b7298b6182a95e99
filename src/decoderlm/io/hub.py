"""Model ids on the Hugging Face Hub as local directories: `--hf HuggingFaceTB/SmolLM2-135M`
(an id, not an existing folder) is downloaded by `huggingface_hub.snapshot_download` into its
usual cache (HF_HUB_CACHE, ~/.cache/huggingface/hub by default), only the files decoderlm reads
(`HUB_FILES`); offline (HF_HUB_OFFLINE=1) a model already in the cache loads without the
network."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import UserError

__all__ = ["HUB_FILES", "hub_directory", "is_hub_id"]

HUB_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "model.safetensors.index.json",
)
"""The files of a Hub repository that are downloaded (snapshot_download's allow_patterns)."""

_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(source: str | Path) -> bool:
    """Whether `source` reads as a Hub model id "owner/name" and is not an existing path."""
    text = str(source)
    return not Path(text).exists() and _ID.fullmatch(text) is not None and ".." not in text


def hub_directory(source: str | Path) -> Path:
    """The local directory of `source`: itself when it is not a Hub id (`is_hub_id`), else
    the snapshot of that repository in the Hugging Face cache, downloaded when missing.

    Raises:
        UserError: huggingface_hub is not installed; offline or the Hub unreachable with the
            model not in the cache; no such repository, or a gated one (one line each,
            saying how to give a folder instead).
    """
    if not is_hub_id(source):
        return Path(source)
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
    except ImportError as e:
        raise UserError(
            f"--hf {source} is not a folder; to download it from the Hugging Face Hub "
            f"install huggingface_hub: pip install 'decoderlm[models]' ({e})"
        ) from None
    folder = "or give a folder holding its files: --hf DIR"
    try:
        return Path(huggingface_hub.snapshot_download(str(source), allow_patterns=HUB_FILES))
    except errors.GatedRepoError:
        raise UserError(
            f"--hf {source}: the Hub model is gated; accept its licence on huggingface.co and "
            f"log in (hf auth login), {folder}"
        ) from None
    except errors.RepositoryNotFoundError:
        raise UserError(
            f"--hf {source} is neither a folder nor a model on the Hugging Face Hub (a "
            f"private one needs hf auth login); check the id, {folder}"
        ) from None
    except errors.LocalEntryNotFoundError:
        offline = constants.HF_HUB_OFFLINE
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        raise UserError(
            f"--hf {source}: {why} and the model is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); download it once online, {folder}"
        ) from None
    except (errors.HfHubHTTPError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"--hf {source}: the download from the Hub failed ({first}); {folder}"
        ) from None
