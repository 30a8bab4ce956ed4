"""Command-line flags from config dataclasses: one `--field-name` per field, its docstring as help.

Every subcommand (grpo_lab.cli.main, launch, train_async, multi_job) builds its flags here, so
no subcommand imports the entry point back.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import types
import typing

from ..core.config import GRPOConfig


def field_docs(cls) -> dict[str, str]:
    """The docstring written under each dataclass field (one copy of the help text)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _scalar_type(annotation):
    """`int | None` -> int; `bool` -> a parser that accepts true/false."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing))  # annotations are strings under __future__
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return _parse_bool if annotation is bool else annotation


def add_config_flags(parser: argparse.ArgumentParser, cls=GRPOConfig, defaults: dict | None = None,
                     exclude: tuple[str, ...] = ()):
    """One `--field-name` flag per dataclass field, with the field's docstring as help.

    A bool flag alone means true (`--enable-lora`); it also takes a value (`--use-lora false`).
    """
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        default = (defaults or {}).get(f.name, f.default)
        kind = _scalar_type(f.type)
        extra = {"nargs": "?", "const": True} if kind is _parse_bool else {}
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", dest=f.name, type=kind,
            default=default, help=f"{docs.get(f.name, '')} (default: {default})", **extra,
        )


def config_from_args(args: argparse.Namespace, cls=GRPOConfig):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if hasattr(args, f.name)})
