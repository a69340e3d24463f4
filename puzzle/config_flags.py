"""Flags defined once, next to the configuration field they fill.

A config dataclass declares a field with ``flag(...)``: its default, its help text and its flag's
name, choices and argparse group live in the field's metadata. ``add_dataclass_args`` turns the
flagged fields of a class into argparse arguments (grouped by topic), ``from_args`` builds the
config from the parsed namespace; the config's own ``__post_init__`` then checks it, with
messages that start with the flag's name (``check`` below). The way Megatron-LM fills its
TransformerConfig from the fields of the dataclass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence



class ArgumentError(ValueError):
    """A flag value (or combination) that cannot run. The message names the flag."""


def fail(flag: str, message: str):
    raise ArgumentError(f"{flag}: {message}")

#: flag kinds: a value ("value"), a switch that sets True ("store_true"), a switch that sets the
#: field to False ("negated", e.g. --no-whiten-advantages), --x/--no-x ("boolean_optional")
KINDS = ("value", "store_true", "negated", "boolean_optional")


@dataclass(frozen=True)
class FlagSpec:
    group: str
    help: Optional[str] = None
    name: Optional[str] = None     # default: --<field name with dashes>
    type: Any = None               # default: the type of the default value
    choices: Optional[Sequence] = None
    kind: str = "value"


def flag(default, group: str, help: Optional[str] = None, *, name: Optional[str] = None, type=None,
         choices=None, kind: Optional[str] = None):
    """A dataclass field whose value comes from a command-line flag (see the module doc)."""
    if kind is None:
        kind = "store_true" if default is False else "value"
    assert kind in KINDS, kind
    spec = FlagSpec(group=group, help=help, name=name, type=type, choices=tuple(choices) if choices else None,
                    kind=kind)
    return dataclasses.field(default=default, metadata={"flag": spec})


def flagged_fields(cls):
    """(field, FlagSpec, flag name, argparse dest) of every flagged field of ``cls``."""
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("flag")
        if spec is None:
            continue
        name = spec.name or "--" + f.name.replace("_", "-")
        yield f, spec, name, name[2:].replace("-", "_")


def flag_name(cls, field_name: str) -> str:
    """The flag of one field (for messages)."""
    for f, _, name, _ in flagged_fields(cls):
        if f.name == field_name:
            return name
    raise KeyError(field_name)


def _group(parser, title: str):
    for g in parser._action_groups:
        if g.title == title:
            return g
    return parser.add_argument_group(title)


def add_dataclass_args(parser, cls) -> None:
    """One argparse argument per flagged field of ``cls``, in its group (created when missing)."""
    import argparse

    for f, spec, name, _ in flagged_fields(cls):
        g = _group(parser, spec.group)
        if spec.kind == "store_true" or spec.kind == "negated":
            g.add_argument(name, action="store_true", help=spec.help)
        elif spec.kind == "boolean_optional":
            g.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, help=spec.help)
        else:
            typ = spec.type or (None if spec.choices else type(f.default))
            g.add_argument(name, type=typ, default=f.default, choices=spec.choices, help=spec.help)


def from_args(cls, args, **overrides):
    """``cls`` from the parsed flags (``overrides``: fields derived elsewhere)."""
    kwargs = {}
    for f, spec, _, dest in flagged_fields(cls):
        value = getattr(args, dest)
        kwargs[f.name] = (not value) if spec.kind == "negated" else value
    kwargs.update(overrides)
    return cls(**kwargs)


def check(cls, obj, field_name: str, ok: bool, message: str) -> None:
    """ArgumentError '--flag: message' unless ``ok``."""
    if not ok:
        fail(flag_name(cls, field_name), message)


def check_at_least(cls, obj, low, *names: str, strict: bool = False, optional: bool = False) -> None:
    """Each field of ``names`` >= ``low`` (> with ``strict``; None passes with ``optional``)."""
    for n in names:
        value = getattr(obj, n)
        if value is None and optional:
            continue
        check(cls, obj, n, value > low if strict else value >= low,
              f"must be {'>' if strict else '>='} {low} (got {value})")
