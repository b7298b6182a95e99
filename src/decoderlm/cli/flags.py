"""A command's flags, read from its function: one flag per parameter, named with dashes.

A parameter's type gives what its flag takes: int, float (finite), str, bool (`--flag`,
`--flag true`, `--flag false`), a `Literal` (its choices), `X | None` (`none` is None),
`list[X]` (the flag repeated once per value) and the `Annotated` checks of
`decoderlm.arguments` (NonNegativeInt, PositiveInt, NotEmptyStr, NotEmptyPath); `dict` takes a
JSON object (a mapping, in a settings file). A parameter
`Annotated[dict | None, Fields(cls, section)]` becomes one flag per field of dataclass `cls`,
nested dataclass fields flattened, and is passed the fields given as a flat dict; one
`Annotated[cls, Fields(cls)]` is passed `cls(**the fields given)` (its default when none is).
Keyword-only parameters are for Python callers and have no flag. The docstring's summary,
description and `Args:` entries (for fields: the "Attributes:" entries or attribute docstrings
of the dataclass and its dataclass bases) are the help. `--config FILE` reads the same settings
from a YAML, JSON or TOML file (its keys: the flags' names with underscores; a `Fields`
parameter's under its section, where it has one); the flags given on the command line override
it, wherever they stand.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import docstring_parser

from ..arguments import Check, Fields
from ..errors import UserError, flag_name

__all__ = ["Command", "FlagError", "Parser", "command_flags", "convert", "words"]

_UNIONS = (typing.Union, types.UnionType)
_WORDS = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "text",
    dict: "a JSON object",
}
_PYTHON = {bool: bool, int: int, float: float, str: str, Path: str}  # Path: given as text


class FlagError(Exception):
    """A flag, or a value in a settings file, that the command cannot take (one line)."""


class Parser(argparse.ArgumentParser):
    """argparse's parser, raising FlagError where argparse would print usage and exit 2."""

    def error(self, message: str):
        raise FlagError(message)


@dataclass
class _Flag:
    name: str  # the parameter or field, as a settings file names it
    hint: Any  # its type; of one value for a list
    section: str | None = None  # the `Fields` parameter it belongs to
    is_list: bool = False
    required: bool = False


def _help(entries) -> dict[str, str]:
    """{name: description} of docstring_parser entries ("a, b: ..." documents a and b)."""
    return {
        name.strip(): " ".join((p.description or "").split())
        for p in entries
        for name in p.arg_name.split(",")
    }


def _plain(hint) -> tuple[Any, bool]:
    """(the type of one value, whether the flag takes a list) of a parameter's type."""
    members = typing.get_args(hint) if typing.get_origin(hint) in _UNIONS else (hint,)
    lists = [m for m in members if typing.get_origin(m) is list]
    return (typing.get_args(lists[0])[0], True) if lists else (hint, False)


def words(hint) -> str:
    """What values a type takes, in words: "an integer > 0", "a number or none", ...

    Raises:
        TypeError: a type that no flag takes.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        checks = [m for m in args[1:] if isinstance(m, Check)]
        return checks[0].words if checks else words(args[0])
    if origin in _UNIONS:
        members = [m for m in args if m is not type(None) and m is not Path] or [str]
        return " or ".join([*map(words, members), *(["none"] if type(None) in args else [])])
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is list:
        return "a list of " + words(args[0])
    if hint in _WORDS or hint is Path or origin is dict:
        return _WORDS.get(origin or hint, "text")
    raise TypeError(f"a flag cannot take values of type {hint!r}")


def convert(hint, value):
    """`value` (a flag's text, or a settings file's value) as a value of type `hint`.

    Raises:
        ValueError: it is not one.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        value = convert(args[0], value)
        if not all(m.test(value) for m in args[1:] if isinstance(m, Check)):
            raise ValueError(value)
        return value
    if origin in _UNIONS:
        if type(None) in args and value in (None, "none", "None", "null"):
            return None
        for member in (m for m in args if m is not type(None)):
            try:
                return convert(member, value)
            except ValueError:
                pass
        raise ValueError(value)
    if origin is Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and value == str(choice)):
                return choice
        raise ValueError(value)
    if hint is dict or origin is dict:
        return _json_object(value)
    if isinstance(value, str) and hint in (bool, int, float):
        value = _from_text(hint, value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) != (hint is bool) or not isinstance(value, _PYTHON[hint]):
        raise ValueError(value)
    if hint is float and not math.isfinite(value):
        raise ValueError(value)
    return value


def _json_object(value) -> dict:
    """A dict, given as one or as the text of a JSON object (ValueError if it is neither)."""
    if isinstance(value, str):
        value = json.loads(value)  # json.JSONDecodeError is a ValueError
    if not isinstance(value, dict):
        raise ValueError(value)
    return value


def _from_text(hint, text: str):
    """A bool, int or float written as text (ValueError if it is none)."""
    if hint is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    return hint(text)


def _converter(hint):
    """argparse's `type` of a flag: convert, with ArgumentTypeError naming what it takes."""

    def converted(text):
        try:
            return convert(hint, text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {words(hint)}, got {str(text)!r}") from None

    return converted


@dataclass
class Command:
    """A command's parser and flags: `parse` turns a command line into the function's
    keyword arguments."""

    parser: Parser
    flags: dict[str, _Flag]  # by argparse dest: the parameter, or "parameter.field"
    sections: dict[str, str]  # a settings file's section -> its `Fields` parameter
    required: dict[str, argparse.Action]  # the flags of parameters without a default
    # the fields of `Fields` parameters without a section: a settings file's key -> dest
    fields: dict[str, str] = dataclasses.field(default_factory=dict)
    # the `Fields` parameters passed a dataclass: parameter -> the dataclass
    builds: dict[str, type] = dataclasses.field(default_factory=dict)

    def parse(self, argv: list[str]) -> dict[str, Any]:
        """The keyword arguments of the command line `argv` (the settings files it names,
        then its flags); only the settings given are there.

        Raises:
            FlagError: a bad flag or value, or a required flag missing (from the settings
                files too).
            UserError / MissingFileError: an unusable settings file; a dataclass passed
                refuses its fields.
        """
        config = Parser(add_help=False, allow_abbrev=False)
        config.add_argument("--config", action="append", default=[])
        values = {}
        for path in config.parse_known_args(argv)[0].config:
            values.update(self._settings_file(path))
        for dest, action in self.required.items():  # given by a settings file, or a flag
            action.required = dest not in values
        given = vars(self.parser.parse_args(argv))
        given.pop("config", None)
        values.update(self._without_alternatives(values, given))
        kwargs: dict[str, Any] = {}
        for dest, value in values.items():
            flag = self.flags[dest]
            if flag.section:
                kwargs.setdefault(flag.section, {})[flag.name] = value
            else:
                kwargs[flag.name] = value
        for param, cls in self.builds.items():
            if param in kwargs:
                kwargs[param] = cls(**kwargs[param])
        return kwargs

    def _without_alternatives(self, values: dict, given: dict) -> dict:
        """`given` (the flags), having removed from `values` (the settings files') the
        alternatives of a flag given: the other fields of a dataclass's ONE_OF (--hf on the
        command line replaces a settings file's `run`)."""
        for cls in self.builds.values():
            one_of = set(getattr(cls, "ONE_OF", ()))
            if any(self.flags[dest].name in one_of for dest in given):
                for dest in [d for d in values if self.flags[d].name in one_of]:
                    del values[dest]
        return given

    def _settings_file(self, path: str) -> dict[str, Any]:
        """The values of a settings file, by argparse dest, each checked as its flag's."""
        from ..files import read_settings  # here: decoderlm.files imports torch

        values = {}
        for key, value in read_settings(path, "--config", "max_steps: 100").items():
            if key in self.sections:
                if not isinstance(value, dict):
                    raise UserError(
                        f"`{key}` in the settings file must map fields to values ({path} has "
                        f"{value!r})"
                    )
                items = [(f"{key}.{k}", f"{self.sections[key]}.{k}", v) for k, v in value.items()]
            else:
                items = [(key, self.fields.get(key, key), value)]
            for name, dest, item in items:
                if dest not in self.flags or "." in key:
                    raise UserError(self._unknown(name, path))
                values[dest] = _file_value(self.flags[dest], item, path)
        return values

    def _unknown(self, name: str, path: str) -> str:
        """The message of a settings file's unknown key `name` (section.field in a section)."""
        text = f"unknown setting '{name}' in the settings file {path}"
        sections = [s for s, p in self.sections.items() if f"{p}.{name}" in self.flags]
        if sections:  # a field written outside its section
            return f"{text}; write it under `{sections[0]}:`"
        return f"{text} (keys: the flags' names, with underscores)"


def _file_value(flag: _Flag, value, path: str):
    """A settings file's value for `flag`, converted as the flag's text is."""
    try:
        if flag.is_list:
            if not isinstance(value, list):
                raise ValueError(value)
            return [convert(flag.hint, v) for v in value]
        return convert(flag.hint, value)
    except ValueError:
        what = words(list[flag.hint] if flag.is_list else flag.hint)
        raise FlagError(
            f"argument {flag_name(flag.name)}: expected {what}, got {str(value)!r} (settings "
            f"file {path})"
        ) from None


def command_flags(
    prog: str, function, metavars: dict[str, str], shown: dict[str, tuple[dict, str]]
) -> Command:
    """The parser of `function`'s flags (see the module docstring).

    Args:
        prog: the command, for its usage line ("decoderlm train").
        function: the command's function.
        metavars: the metavar of a flag by name (DIR, FILE, ...; default: its name in capitals).
        shown: for a `Fields` parameter, the defaults its flags show (by field) and a note
            added to its group's description (default: the dataclass's own defaults).

    Raises:
        TypeError: a parameter without a type a flag can take (a bug).
    """
    doc = docstring_parser.parse(function.__doc__ or "")
    description = doc.long_description or doc.short_description
    parser = Parser(prog=prog, description=description, allow_abbrev=False)
    command, helps = Command(parser, {}, {}, {}), _help(doc.params)
    hints = typing.get_type_hints(function, include_extras=True)
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [p for p in inspect.signature(function).parameters.values() if p.kind in kinds]
    if not params:
        return command
    config = parser.add_argument(
        "--config", action="append", metavar="FILE", default=argparse.SUPPRESS
    )
    config.help = (
        "a YAML, JSON or TOML (.toml) file of this command's settings, named as the flags "
        "with underscores; the flags override it"
    )
    for p in params:
        base, *marks = typing.get_args(hints[p.name]) or (None,)
        fields = [m for m in marks if isinstance(m, Fields)]
        if fields:
            values, note = shown.get(p.name, ({}, ""))
            help = f"{helps.get(p.name, '')} {note}"
            _add_fields(command, p.name, fields[0], help, values, metavars)
            if base is fields[0].cls:
                command.builds[p.name] = base
            if fields[0].section:
                config.help += f"; {fields[0].cls.__name__} fields under `{fields[0].section}`"
        else:
            hint, is_list = _plain(hints[p.name])
            flag = _Flag(p.name, hint, None, is_list, p.default is inspect.Parameter.empty)
            _add(command, parser, flag, helps.get(p.name, ""), p.default, metavars)
    return command


def _add_fields(
    command: Command, param: str, marker: Fields, help: str, shown: dict, metavars: dict
) -> None:
    """The flags of the fields of `marker.cls` (a group for it and one for each nested
    dataclass; without a section, among the command's own flags, with their `metavars`),
    showing the defaults `shown` (else the dataclass's)."""
    if marker.section:
        command.sections[marker.section] = param
    groups: dict[type, Any] = {}
    for owner, name, hint, text, default in _fields(marker.cls, marker.cls()):
        if not marker.section:
            groups[owner] = command.parser
            command.fields[name] = f"{param}.{name}"
        if owner not in groups:
            about = docstring_parser.parse_from_object(owner).short_description or ""
            title = f"{marker.section} settings ({owner.__name__})"
            groups[owner] = command.parser.add_argument_group(
                title, help.strip() if owner is marker.cls else about
            )
        hint, is_list = _plain(hint)
        flag = _Flag(name, hint, param, is_list)
        own = metavars if not marker.section else {}
        _add(command, groups[owner], flag, text, shown.get(name, default), own)


def _fields(cls, instance):
    """(dataclass, field, type, help, default) of every field of dataclass `cls`, the fields
    of a field that is itself a dataclass in its place."""
    hints = typing.get_type_hints(cls, include_extras=True)
    helps = {}
    for base in reversed(cls.__mro__):  # a dataclass base's fields: its help
        if dataclasses.is_dataclass(base):
            helps.update(_help(docstring_parser.parse_from_object(base).params))
    for field in dataclasses.fields(cls):
        value = getattr(instance, field.name)
        if dataclasses.is_dataclass(hints[field.name]):
            yield from _fields(hints[field.name], value)
        else:
            yield cls, field.name, hints[field.name], helps.get(field.name, ""), value


def _add(command: Command, group, flag: _Flag, help: str, default, metavars) -> None:
    """Add `flag` to `group` (of command.parser): given values only (no default), its help
    ending with the default shown."""
    dest = f"{flag.section}.{flag.name}" if flag.section else flag.name
    choices = _choices(flag.hint)
    if not flag.required and not (default is None or default is False or default == []):
        help += f" (default: {str(default).lower() if isinstance(default, bool) else default})"
    options = dict(dest=dest, default=argparse.SUPPRESS, type=_converter(flag.hint))
    options.update(required=flag.required, help=help.replace("%", "%%").strip())
    if flag.hint is bool or _optional_bool(flag.hint):  # --flag, --flag true|false
        options.update(nargs="?", const=True, metavar="true|false")
    else:
        metavar = "{" + ",".join(choices) + "}" if choices else None
        options["metavar"] = metavar or metavars.get(flag.name, flag.name.upper())
    if flag.is_list:
        options["action"] = "append"
    words(flag.hint)  # a type no flag takes is refused now, not when the flag is given
    action = group.add_argument(flag_name(flag.name), **options)
    command.flags[dest] = flag
    if flag.required:
        command.required[dest] = action


def _optional_bool(hint) -> bool:
    """Whether a type is `bool | None` (a bool flag whose absence the function tells apart)."""
    return typing.get_origin(hint) in _UNIONS and set(typing.get_args(hint)) == {bool, type(None)}


def _choices(hint) -> list[str]:
    """The values of a Literal type (also inside Annotated; inside `| None` followed by
    "none", which `convert` reads as None), else []."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _choices(args[0])
    if origin in _UNIONS:
        choices = [choice for member in args for choice in _choices(member)]
        return choices + ["none"] if choices and type(None) in args else choices
    return [str(a) for a in args] if origin is Literal else []
