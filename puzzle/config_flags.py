"""Flags defined once, next to the configuration field they fill.

A config dataclass declares a field with ``flag(...)``: its default, its help text and its flag's
name, choices and argparse group live in the field's metadata. ``add_dataclass_args`` turns the
flagged fields of a class into argparse arguments (grouped by topic), ``from_args`` builds the
config from the parsed namespace; the config's own ``__post_init__`` then checks it, with
messages that start with the flag's name (``check`` below). The way Megatron-LM fills its
TransformerConfig from the fields of the dataclass.

One field, one definition, also where a flag has more than one name: ``aliases`` (further option
strings), ``switches`` (store-true flags that set the field to a value: ``--bf16``,
``--use-flash-attn``) and role flags (``roles``: ``--critic-num-layers`` overrides
``--num-layers`` for the critic; ``from_args(cls, args, for_role="critic")`` reads them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple


class ArgumentError(ValueError):
    """A flag value (or combination) that cannot run. The message names the flag."""


def fail(flag: str, message: str):
    raise ArgumentError(f"{flag}: {message}")

#: flag kinds: a value ("value"), a switch that sets True ("store_true"), a switch that sets the
#: field to False ("negated", e.g. --no-whiten-advantages), --x/--no-x ("boolean_optional"),
#: only the ``switches`` of the spec and no flag of the field's own name ("switches", e.g. --bf16)
KINDS = ("value", "store_true", "negated", "boolean_optional", "switches")
_FIELD_DEFAULT = object()  # FlagSpec.flag_default: the flag's default is the field's


@dataclass(frozen=True)
class FlagSpec:
    """A field's flag. Role flags: for every prefix of ``roles`` a flag ``--<prefix>-<name>``
    (``role_name``: another pattern) that overrides the field for that role; unset (None) the
    role takes the unprefixed flag's value (``role_only``: there is none; the field's default)."""

    group: str
    help: Optional[str] = None
    name: Optional[str] = None     # default: --<field name with dashes>
    type: Any = None               # default: the type of the default value
    choices: Optional[Sequence] = None
    kind: str = "value"
    flag_default: Any = _FIELD_DEFAULT  # None: "not given" (required, or derived by validate_args)
    aliases: Tuple[str, ...] = ()  # further option strings of the same flag
    #: (option, value, help): switches that set the field to value (--use-flash-attn, --bf16);
    #: two of them, or one with a different explicit value of the flag, is an error naming both
    switches: Tuple[Tuple[str, Any, Optional[str]], ...] = ()
    roles: Tuple[str, ...] = ()
    role_name: Any = "--{role}-{flag}"  # {flag}: the flag's name without its dashes; or {role: option}
    role_help: Any = None          # "{role}: ..." pattern, or {prefix: help}
    role_group: Optional[str] = None   # "{role} ..." pattern (default: the flag's group)
    role_only: bool = False


def flag(default, group: str, help: Optional[str] = None, *, name: Optional[str] = None, type=None,
         choices=None, kind: Optional[str] = None, **more):
    """A dataclass field whose value comes from a command-line flag (see the module doc; ``more``:
    the other FlagSpec attributes)."""
    if kind is None:
        kind = "store_true" if default is False else "value"
    assert kind in KINDS, kind
    spec = FlagSpec(group=group, help=help, name=name, type=type, choices=tuple(choices) if choices else None,
                    kind=kind, **more)
    return dataclasses.field(default=default, metadata={"flag": spec})


def _dest(name: str) -> str:
    return name[2:].replace("-", "_")


def _flag_default(f, spec: FlagSpec):
    """The flag's argparse default (the field's unless FlagSpec.flag_default says otherwise)."""
    return f.default if spec.flag_default is _FIELD_DEFAULT else spec.flag_default


def flagged_fields(cls):
    """(field, FlagSpec, flag name, argparse dest) of every flagged field of ``cls``."""
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("flag")
        if spec is None:
            continue
        name = spec.name or "--" + f.name.replace("_", "-")
        yield f, spec, name, _dest(name)


def role_flag(spec: FlagSpec, name: str, role: str) -> str:
    """The flag of ``role`` for a field whose own flag is ``name``."""
    if isinstance(spec.role_name, dict):
        return spec.role_name[role]
    return spec.role_name.format(role=role, flag=name[2:])


def flag_name(cls, field_name: str) -> str:
    """The flag of one field (for messages)."""
    for f, spec, name, _ in flagged_fields(cls):
        if f.name == field_name:
            if spec.kind == "switches":
                return "/".join(option for option, _, _ in spec.switches)
            return name
    raise KeyError(field_name)


def _group(parser, title: str):
    for g in parser._action_groups:
        if g.title == title:
            return g
    return parser.add_argument_group(title)


def _role_help(spec: FlagSpec, role: str) -> Optional[str]:
    if isinstance(spec.role_help, dict):
        return spec.role_help.get(role)
    return spec.role_help.format(role=role) if spec.role_help else None


def add_dataclass_args(parser, cls, choices: Optional[dict] = None, only: Optional[tuple] = None) -> None:
    """One argparse argument per flagged field of ``cls``, in its group (created when missing), and
    its role flags. ``choices``: field -> the choices of flags whose values are registered above
    the config layer (the advantage estimators). ``only``: just these fields (a tool that shares a
    few of the training flags)."""
    import argparse

    choices = choices or {}
    for f, spec, name, _ in flagged_fields(cls):
        if only is not None and f.name not in only:
            continue
        g = _group(parser, spec.group)
        options = (name,) + spec.aliases
        typ = spec.type or (None if spec.choices or f.name in choices else type(f.default))
        default = _flag_default(f, spec)
        kwargs = dict(type=typ, choices=choices.get(f.name, spec.choices))
        if spec.kind == "switches" or spec.role_only:
            pass  # no flag of the field's own name
        elif spec.kind == "store_true" or spec.kind == "negated":
            g.add_argument(*options, action="store_true", help=spec.help)
        elif spec.kind == "boolean_optional":
            g.add_argument(*options, action=argparse.BooleanOptionalAction, default=default, help=spec.help)
        else:
            g.add_argument(*options, default=default, help=spec.help, **kwargs)
        for option, _, text in spec.switches:
            g.add_argument(option, action="store_true", help=text)
        for role in spec.roles:
            rg = _group(parser, spec.role_group.format(role=role)) if spec.role_group else g
            rg.add_argument(role_flag(spec, name, role), default=default if spec.role_only else None,
                            help=_role_help(spec, role), **kwargs)


def _switched(spec: FlagSpec, name: str, args, value):
    """The value the spec's switches set (or ``value``); two switches, or a switch and a different
    explicit value of the flag, is an error naming both."""
    on = [(option, v) for option, v, _ in spec.switches if getattr(args, _dest(option))]
    if len(on) > 1:
        fail("/".join(option for option, _ in on), "choose one")
    if not on:
        return value
    option, switched = on[0]
    if spec.kind != "switches" and value is not None and value != switched:
        fail(f"{option}/{name}", f"{option} means {name} {switched}; it contradicts {name} {value}")
    return switched


def _value(f, spec, name, dest, args, for_role, fallback):
    value = None if spec.kind == "switches" or spec.role_only else getattr(args, dest)
    if for_role in spec.roles:
        own = getattr(args, _dest(role_flag(spec, name, for_role)))
        if own is not None:
            value = own
        elif fallback is not None:
            return getattr(fallback, f.name)
    if spec.switches:
        value = _switched(spec, name, args, value)
    if spec.kind == "negated":
        value = not value
    return f.default if value is None else value


def field_value(cls, args, field_name: str, for_role: Optional[str] = None):
    """The value ``from_args`` gives one field (checked where a run needs it before the config)."""
    for f, spec, name, dest in flagged_fields(cls):
        if f.name == field_name:
            return _value(f, spec, name, dest, args, for_role, None)
    raise KeyError(field_name)


def from_args(cls, args, for_role: Optional[str] = None, fallback=None, **overrides):
    """``cls`` from the parsed flags (``overrides``: fields derived elsewhere). ``for_role``: its
    role flags override the fields' flags; a role flag left unset takes the field of ``fallback``
    (an instance), else the field's flag. A flag left at None (not given) gives the field's default."""
    kwargs = {f.name: _value(f, spec, name, dest, args, for_role, fallback)
              for f, spec, name, dest in flagged_fields(cls) if f.name not in overrides}
    kwargs.update(overrides)
    return cls(**kwargs)


def flags_given(cls, args) -> dict:
    """field name -> its flag, for the (unprefixed) flags of ``cls`` set on the command line to
    something else than their default (a switch: set)."""
    given = {}
    for f, spec, name, dest in flagged_fields(cls):
        on = [option for option, _, _ in spec.switches if getattr(args, _dest(option))]
        if on:
            given[f.name] = on[0]
        elif spec.kind != "switches" and not spec.role_only:
            raw = getattr(args, dest)
            default = False if spec.kind in ("store_true", "negated") else _flag_default(f, spec)
            if raw != default:
                given[f.name] = name
    return given


def role_flags_given(cls, args, for_role: str):
    """The role flags of ``for_role`` set on the command line (flag, field name)."""
    out = []
    for f, spec, name, _ in flagged_fields(cls):
        if for_role in spec.roles:
            option = role_flag(spec, name, for_role)
            raw = getattr(args, _dest(option))
            if raw != (_flag_default(f, spec) if spec.role_only else None):
                out.append((option, f.name))
    return out


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
