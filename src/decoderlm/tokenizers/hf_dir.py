"""A Hugging Face model directory's tokenizer as an `HFTokenizer` (`read_hf_tokenizer`).

The files, as transformers reads them:

    tokenizer.json            the tokenizer (Hugging Face's tokenizers library); required
    tokenizer_config.json     bos_token / eos_token (a string, or an object {"content": ...}),
                              add_bos_token, chat_template (a string, or a list of named
                              templates {"name", "template"}: the one named "default", else
                              the first)
    chat_template.jinja       the chat template (wins over tokenizer_config.json's)
    chat_template.json        {"chat_template": ...} (after the .jinja file, before the config)
    generation_config.json    bos_token_id, eos_token_id (an id or a list of ids); where the
                              file is missing, config.json's fields of the same names

The end-of-text ids are tokenizer_config.json's eos_token, then the generation ids, each once.
add_bos is tokenizer_config.json's add_bos_token where it says; otherwise whether the
tokenizer's post-processor puts the BOS token first (Llama 3's tokenizer.json does).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MissingFileError, UserError
from ..files import read_json
from .base import HF_TOKENIZER_NAME
from .huggingface import HFTokenizer, _from_document, tokenizers_package

__all__ = ["CHAT_TEMPLATE_SOURCES", "read_hf_tokenizer"]

CHAT_TEMPLATE_SOURCES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
"""Where a directory's chat template is looked for, in order; the first found wins."""


def read_hf_tokenizer(directory: str | Path) -> HFTokenizer:
    """The tokenizer of a Hugging Face model directory (see the module docstring).

    Raises:
        MissingFileError: no tokenizer.json. UserError: the tokenizers package is missing, a
            malformed file, or a bos / eos token that is not in the vocabulary.
    """
    directory = Path(directory)
    path = directory / HF_TOKENIZER_NAME
    if not path.is_file():
        raise MissingFileError(f"{directory} has no {HF_TOKENIZER_NAME}")
    library = _from_document(tokenizers_package(), path.read_text(encoding="utf-8"), str(path))
    config = _optional_json(directory / "tokenizer_config.json")
    generation_path = directory / "generation_config.json"
    if not generation_path.is_file():
        generation_path = directory / "config.json"
    generation = _optional_json(generation_path)
    source = str(directory / "tokenizer_config.json")
    bos = _token_id(library, config.get("bos_token"), "bos_token", source)
    if bos is None:
        bos = next(
            iter(_ids(generation.get("bos_token_id"), "bos_token_id", generation_path)), None
        )
    eos = _token_id(library, config.get("eos_token"), "eos_token", source)
    eos_ids = [] if eos is None else [eos]
    eos_ids += _ids(generation.get("eos_token_id"), "eos_token_id", generation_path)
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = _post_processor_adds(library, bos)
    return HFTokenizer(
        library,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        add_bos=add_bos,
        chat_template=_chat_template(directory, config),
    )


def _optional_json(path: Path) -> dict:
    """The object a JSON file holds, {} when there is no such file.

    Raises:
        UserError: not JSON, or not an object.
    """
    if not path.is_file():
        return {}
    data = read_json(path)
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


def _token_id(library, token, name: str, source: str) -> int | None:
    """The id of a tokenizer_config.json special token (a string or {"content": ...})."""
    if isinstance(token, dict):
        token = token.get("content")
    if token is None:
        return None
    found = library.token_to_id(token) if isinstance(token, str) else None
    if found is None:
        raise UserError(f"{source}: its {name} {token!r} is not in the tokenizer's vocabulary")
    return found


def _ids(value, name: str, source: Path) -> list[int]:
    """A generation_config.json id field (None, an id, or a list of ids) as a list."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in values):
        raise UserError(f"{source}: {name} must be a token id or a list of ids, got {value!r}")
    return values


def _post_processor_adds(library, bos: int | None) -> bool:
    """Whether the tokenizer's post-processor puts `bos` before the text's ids."""
    if bos is None:
        return False
    plain = library.encode("a", add_special_tokens=False).ids
    return library.encode("a", add_special_tokens=True).ids[:1] == [bos] != plain[:1]


def _chat_template(directory: Path, config: dict) -> str | None:
    """The first chat template found in CHAT_TEMPLATE_SOURCES, None when none has one.

    Raises:
        UserError: a chat_template that is neither a string nor a list of named templates.
    """
    jinja = directory / CHAT_TEMPLATE_SOURCES[0]
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for source, data in (
        (
            directory / CHAT_TEMPLATE_SOURCES[1],
            _optional_json(directory / CHAT_TEMPLATE_SOURCES[1]),
        ),
        (directory / CHAT_TEMPLATE_SOURCES[2], config),
    ):
        template = data.get("chat_template")
        if template is None:
            continue
        if (
            isinstance(template, list)
            and template
            and all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template)
        ):
            named = {t.get("name"): t["template"] for t in template}
            return named.get("default", template[0]["template"])
        if not isinstance(template, str):
            raise UserError(
                f"{source}: chat_template must be a string or a list of "
                f'{{"name": ..., "template": ...}} objects'
            )
        return template
    return None
