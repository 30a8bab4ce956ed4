"""Command-line flags from config dataclasses: one `--field-name` per field, its docstring as help.

Every command module (grpo_lab.cli.serve, launch, train_async, ...) builds its flags here, so no
command imports the entry point back.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import types
import typing

from ..util.argv import parse_bool

BOOL_FLAG = {"type": parse_bool, "nargs": "?", "const": True}
"""A bool flag (grpo_lab.util.argv's convention): alone it means true, or takes a value."""


class StoreGiven(argparse.Action):
    """Store the value, and remember that the flag was given (`args.given_flags`): a value given
    on the command line wins over a command's own defaults even when it equals the config's."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given_flags = {*getattr(namespace, "given_flags", ()), self.dest}


def given_flags(args: argparse.Namespace) -> set[str]:
    """The config fields whose flags were given on the command line."""
    return set(getattr(args, "given_flags", ()))


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


def _scalar_type(annotation):
    """`int | None` -> int."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing))  # annotations are strings under __future__
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def add_config_flags(parser: argparse.ArgumentParser, cls=None, defaults: dict | None = None,
                     exclude: tuple[str, ...] = ()):
    """One `--field-name` flag per dataclass field, with the field's docstring as help.

    A bool flag alone means true (`--enable-lora`); it also takes a value (`--use-lora false`):
    grpo_lab.util.argv's `flag_args` writes them that way. `cls` defaults to GRPOConfig.
    """
    cls = cls or _grpo_config()
    from ..train.config import RENAMED
    old_names = {new: old for old, new in RENAMED.items()}  # the old flag still works
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        default = (defaults or {}).get(f.name, f.default)
        kind = _scalar_type(f.type)
        names = [f.name] + ([old_names[f.name]] if f.name in old_names else [])
        parser.add_argument(
            *(f"--{name.replace('_', '-')}" for name in names), dest=f.name, default=default,
            action=StoreGiven,
            # argparse %-formats help text: a literal % (e.g. "~30 % more time") is doubled
            help=f"{docs.get(f.name, '')} (default: {default})".replace("%", "%%"),
            **(BOOL_FLAG if kind is bool else {"type": kind}),
        )


def _grpo_config():
    from ..train.config import GRPOConfig  # imports torch: only when a command needs it

    return GRPOConfig


def config_from_args(args: argparse.Namespace, cls=None):
    cls = cls or _grpo_config()
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if hasattr(args, f.name)})
