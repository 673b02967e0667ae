"""Engine flags for every command, generated from the config fields (iterserve/config.py).

A field's default, choices, bounds and help are written once, in the field; this turns them into
argparse flags: `max_num_seqs` -> `--max-num-seqs`, a bool that defaults to True -> `--no-...`.
"""
from __future__ import annotations

import argparse
import sys
import types
import typing
from typing import Iterable, Literal

from pydantic import ValidationError

from iterserve.config import FIELD_NAMES, SECTIONS, EngineConfig, format_validation_error, parse_bytes

_TITLES = {"model_config": "model", "cache_config": "KV cache", "scheduler_config": "scheduler",
           "parallel_config": "parallel", "speculative_config": "speculative decoding"}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or isinstance(action, argparse._StoreConstAction) \
                or "(default" in text:
            return text
        return f"{text} (default: {action.default})"


def add_engine_args(parser: argparse.ArgumentParser, exclude: Iterable[str] = ()) -> None:
    """One flag per engine setting, minus `exclude` (settings a command decides itself)."""
    for section, cls in SECTIONS.items():
        add_config_args(parser, cls, _TITLES[section], exclude)


def add_config_args(parser: argparse.ArgumentParser, cls, title: str, exclude: Iterable[str] = (),
                    defaults: dict | None = None) -> None:
    """One flag per field of a config class; `defaults` where the environment gives one."""
    group, defaults = parser.add_argument_group(title), defaults or {}
    for name, info in cls.__pydantic_fields__.items():
        if name not in exclude:
            _add_flag(group, name, info, defaults.get(name, info.default))


def _add_flag(group, name: str, info, default) -> None:
    flag, kind = "--" + name.replace("_", "-"), _base_type(info.annotation)
    text = (info.description or "") + _bounds(info)
    if kind is bool:
        if default:
            group.add_argument("--no-" + name.replace("_", "-").removeprefix("enable-").removeprefix("use-"),
                               dest=name, action="store_false", help=text + " (on by default; this turns it off)")
        else:
            group.add_argument(flag, dest=name, action="store_true", help=text)
        return
    if typing.get_origin(kind) is list:  # NAME=PATH ... (lora_modules)
        group.add_argument(flag, dest=name, nargs="+", default=None,  # None: the field's empty list
                           help=text, metavar=name.split("_")[-1].upper().removesuffix("S"))
        return
    choices = list(typing.get_args(kind)) if typing.get_origin(kind) is Literal else None
    convert = _byte_size if _is_byte_size(info) else (str if choices else kind)
    group.add_argument(flag, dest=name, type=convert, default=default, choices=choices, help=text,
                       metavar=None if choices else name.split("_")[-1].upper())


def _is_byte_size(info) -> bool:
    """A `Bytes` field: pydantic keeps its parse_bytes validator in the metadata or the annotation."""
    return "parse_bytes" in repr(info.metadata) + repr(info.annotation)


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(exc)) from None


def _base_type(annotation):
    """int | None -> int; Annotated[int, ...] -> int; Literal[...] stays."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and args:
        return _base_type(args[0])
    return annotation


def _bounds(info) -> str:
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    found = [f"{words[k]} {getattr(m, k)}" for m in info.metadata for k in words if hasattr(m, k)]
    return f"; {', '.join(found)}" if found else ""


def config_from_args(args: argparse.Namespace, cls=EngineConfig, **overrides):
    """The config the parsed flags describe; a bad value exits with one line, not a traceback."""
    names = FIELD_NAMES if cls is EngineConfig else tuple(cls.__pydantic_fields__)
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    values.update(overrides)
    try:
        return cls(**values)
    except ValidationError as exc:
        fail(format_validation_error(exc))
    except ValueError as exc:
        fail(str(exc))


def fail(message: str, code: int = 2) -> typing.NoReturn:
    """A user error on the command line: one line on stderr and an exit status, never a traceback."""
    print(f"iterserve: error: {message}", file=sys.stderr)
    raise SystemExit(code)


__all__ = ["HelpFormatter", "add_config_args", "add_engine_args", "config_from_args", "fail"]
