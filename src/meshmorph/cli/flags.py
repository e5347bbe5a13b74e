"""Command-line flags taken from documented dataclasses: the help is the field's docstring and
the default is the field's default, so both are stated once, where the setting lives.

    add_fields(parser, ValidateConfig, "nproc", "model", num_plans="--plans")

adds ``--nproc`` and ``--model`` (and ``--plans`` for ``num_plans``); ``config_from(args,
ValidateConfig)`` builds the dataclass back from the parsed flags it knows.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshmorph.cli.args import positive_float, positive_int


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls`` (and of its bases), by name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, after in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                    and isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def field_default(cls: type, name: str) -> Any:
    """The default of field ``name`` of ``cls`` (its factory's value for a factory)."""
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if f is None:
        raise KeyError(f"{cls.__name__} has no field {name!r}")
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default; give the flag one")


def _parser_for(kind: Any, default: Any
                ) -> tuple[Callable[[str], Any] | None, list[str] | None, bool]:
    """(type, choices, is_flag) of an annotation: bool -> a switch, an enum -> its values as
    choices (ints for an IntEnum), int/float -> numbers (positive ones where the default is
    positive), Path, str; ``X | None`` as X."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        kind = args[0]
    if kind is bool:
        return None, None, True
    if isinstance(kind, type) and issubclass(kind, enum.IntEnum):
        return int, [m.value for m in kind], False
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return str, [str(m.value) for m in kind], False
    positive = isinstance(default, int | float) and default > 0
    simple = {int: positive_int if positive else int,
              float: positive_float if positive else float, Path: Path, str: str}
    return simple.get(kind, str), None, False


def add_field(parser: argparse.ArgumentParser, cls: type, name: str, flag: str | None = None,
              **overrides: Any) -> None:
    """Add one flag for field ``name`` of ``cls``: help from its docstring with the default
    appended, default from the field, type from its annotation (``overrides`` win)."""
    default = overrides.pop("default", field_default(cls, name))
    parse, choices, is_flag = _parser_for(typing.get_type_hints(cls)[name], default)
    doc = field_docs(cls).get(name, "").replace("``", "")  # reST literals read plainly
    shown = default.value if isinstance(default, enum.Enum) else default
    help_text = overrides.pop("help", doc)
    if not is_flag and shown is not None and "(default" not in help_text:
        help_text = f"{help_text} (default {shown})"
    elif is_flag and default and help_text == doc:  # a flag that turns a default off
        help_text = f"turns off (default on): {doc}"
    kwargs: dict[str, Any] = {"dest": name, "default": default, "help": help_text}
    flag = flag or "--" + name.replace("_", "-")
    if is_flag:
        kwargs["action"] = "store_false" if default else "store_true"
    elif choices:
        kwargs.update(type=parse, choices=choices)
    else:
        kwargs.update(type=parse, metavar=flag.lstrip("-").upper().replace("-", "_"))
    kwargs.update(overrides)
    parser.add_argument(flag, **kwargs)


def add_fields(parser: argparse.ArgumentParser, cls: type, *names: str,
               **flags: str) -> None:
    """``add_field`` for each of ``names`` (flag ``--name``) and each ``field=flag`` pair."""
    for name in names:
        add_field(parser, cls, name)
    for name, flag in flags.items():
        add_field(parser, cls, name, flag)


def config_from(args: argparse.Namespace, cls: type, **extra: Any) -> Any:
    """``cls`` built from the parsed flags that name its fields, plus ``extra``."""
    known = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in known}
    return cls(**(values | extra))
