"""One definition per component's configuration, as vLLM's `EngineArgs` is.

A component (`allocator`, `worker`, `router`, `up`) describes its settings
once, as a frozen dataclass whose fields are made with `setting(...)`: type
(the annotation), default, help, and whether it is a flag. From it come

- its argparse flags (`add_arguments`): `--FIELD-NAME`, parsed by the field's
  type (or `parse=`); a `bool` is a switch (`--FLAG`, or `--FLAG`/`--no-FLAG`
  when on by default);
- its environment variables: every field, flag or not, is also
  `PAGEDKV_<COMPONENT>_<FIELD>` (`settings.env_name`); a flag on the command
  line wins; a field with `flag=False` is set by its variable alone;
- the configuration reference (`reference_markdown`): flag, variable, default
  and help of every field;
- the values (`from_args`): the dataclass built from the parsed flags and the
  variables; its `__post_init__` checks them, and a bad one is a `CliError`.

A setting that an operator may tune but no user gives on a command line is a
field with `flag=False`: a variable only, in the reference like every other.

A launcher's config names the components it starts in its `hands_on`
(`UpArgs.hands_on`: the worker's and the router's configs). It offers their
`stack=True` fields as flags of its own (`add_arguments` adds them,
`passthrough`) and hands the ones given on to each process (`to_argv`); every
other setting of theirs reaches them through their variables, which child
processes inherit. Its reference lists the offered flags with the variables
the processes read.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

from pagedkv_base.settings import (
    CliError,
    EnvValue,
    env_default,
    env_name,
    env_switch,
    from_env,
    parse_bool,
)

_KEY = "pagedkv"


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    """What a field says beyond its type and default."""

    help: str
    flag: bool = True
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    # a second variable read when the component's own is not set (e.g. VLLM_API_KEY)
    fallback_env: str | None = None
    # offered by the launcher (`pagedkv up`) and passed to every process of the component
    stack: bool = False
    # the default as the reference shows it, when it is computed (a fresh id, the model's length)
    shown_default: str | None = None
    # an argparse store action of the component's own
    # (e.g. one that records that the flag was given)
    action: type[argparse.Action] | None = None


def setting(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with its help and flag (see `Setting` for the keywords)."""
    return dataclasses.field(default=default, metadata={_KEY: Setting(help=help, **kwargs)})


def component_of(cls: type) -> str:
    return cls.component  # type: ignore[attr-defined]


def handed_on(cls: type) -> tuple[type, ...]:
    """The configs of the components a launcher's config `cls` starts (its `hands_on`)."""
    return tuple(getattr(cls, "hands_on", ()))


def _settings(cls: type) -> Iterable[tuple[dataclasses.Field, Setting, Any]]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_KEY)
        if meta is not None:
            yield f, meta, hints[f.name]


def _base_type(hint: Any) -> Any:
    """`int | None` -> int; other hints as they are."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _parser_of(meta: Setting, hint: Any) -> Callable[[str], Any]:
    if meta.parse is not None:
        return meta.parse
    base = _base_type(hint)
    if base is bool:
        return parse_bool
    if base in (int, float, str):
        return base
    raise TypeError(f"give parse= for a setting of type {hint!r}")


def flag_of(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def name_of(cls: type, field: str) -> str:
    """How a user gives the setting `field` of `cls`: its flag, or its variable when it
    has none (for messages about it)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == field)
    return flag_of(f) if f.metadata[_KEY].flag else env_name(component_of(cls), flag_of(f))


def _shown(default: Any) -> str:
    if default is None:
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def _help(cls: type, f: dataclasses.Field, meta: Setting) -> str:
    default = meta.shown_default or _shown(f.default)
    var = env_name(component_of(cls), flag_of(f))
    also = f", else {meta.fallback_env}" if meta.fallback_env else ""
    return f"{meta.help} [default: {default}] [{var}{also}]".replace("%", "%%")


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    passthrough: bool = False,
) -> None:
    """The flags of `cls`'s fields, then (for a launcher) a group of each config it hands
    on to. `passthrough`: only its `stack=True` fields, for a launcher that hands them
    on: absent unless given (the processes read their own variables), kept as the text
    given (`to_argv`)."""
    _add_own(parser, cls, passthrough)
    if not passthrough:
        for other in handed_on(cls):
            name = component_of(other)
            group = parser.add_argument_group(f"{name} settings, handed to each {name} process")
            _add_own(group, other, True)


def _add_own(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, passthrough: bool
) -> None:
    component = component_of(cls)
    for f, meta, hint in _settings(cls):
        if not meta.flag or (passthrough and not meta.stack):
            continue
        flag, convert = flag_of(f), _parser_of(meta, hint)
        kwargs: dict[str, Any] = {"dest": f.name, "help": _help(cls, f, meta)}
        if meta.metavar:
            kwargs["metavar"] = meta.metavar
        if meta.choices:
            kwargs["choices"] = meta.choices
        if meta.action and not passthrough:
            kwargs["action"] = meta.action
        if _base_type(hint) is bool:
            switch = env_switch(component, flag, f.default)
            if passthrough:
                switch["default"] = argparse.SUPPRESS
            parser.add_argument(flag, **switch, **kwargs)
            continue
        if passthrough:

            def as_given(text: str, convert=convert) -> str:
                convert(text)  # refused here, before any process starts, when it would be there
                return text

            as_given.__name__ = getattr(convert, "__name__", "value")
            parser.add_argument(flag, type=as_given, default=argparse.SUPPRESS, **kwargs)
            continue
        env = env_default(component, flag, f.default, convert)
        if (
            meta.fallback_env
            and not isinstance(env["default"], EnvValue)
            and os.environ.get(meta.fallback_env)
        ):
            env["default"] = EnvValue(os.environ[meta.fallback_env], meta.fallback_env)
        parser.add_argument(flag, **env, **kwargs)


def to_argv(cls: type, args: argparse.Namespace) -> list[str]:
    """The `stack=True` flags of `cls` given to a launcher (`passthrough`), as a process's argv."""
    out: list[str] = []
    for f, meta, hint in _settings(cls):
        if not meta.stack or f.name not in vars(args):
            continue
        value = getattr(args, f.name)
        if _base_type(hint) is bool:
            out.append(flag_of(f) if value else "--no-" + flag_of(f)[2:])
        else:
            out += [flag_of(f), str(value)]
    return out


def _from_environment(cls: type, f: dataclasses.Field, meta: Setting, hint: Any) -> Any:
    name = env_name(component_of(cls), flag_of(f))
    raw = os.environ.get(name)
    if raw is None:
        return f.default
    try:
        value = from_env(_parser_of(meta, hint))(EnvValue(raw, name))
    except argparse.ArgumentTypeError as exc:
        raise CliError(str(exc)) from None
    if meta.choices and value not in meta.choices:
        raise CliError(f"{name}={raw!r}: expected one of {', '.join(meta.choices)}")
    return value


def from_args(cls: type, args: argparse.Namespace, **overrides: Any):
    """`cls` from parsed flags (those its parser has) and the variables of the others."""
    values: dict[str, Any] = {}
    for f, meta, hint in _settings(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif meta.flag and hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
        else:
            values[f.name] = _from_environment(cls, f, meta, hint)
    try:
        return cls(**values)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def reference_markdown(cls: type) -> str:
    """The configuration reference of one component: a Markdown table of every
    setting, its flag (none: a variable only), variable, default and help; for a
    launcher, then the flags it hands on, with the variables its processes read."""
    rows = ["| flag | environment variable | default | what it sets |", "| --- | --- | --- | --- |"]
    rows += [_row(cls, f, meta, hint) for f, meta, hint in _settings(cls)]
    for other in handed_on(cls):
        to = f"each {component_of(other)}'s own: "
        rows += [_row(other, f, meta, hint, to) for f, meta, hint in _settings(other) if meta.stack]
    return "\n".join(rows) + "\n"


def _row(cls: type, f: dataclasses.Field, meta: Setting, hint: Any, prefix: str = "") -> str:
    switch = _base_type(hint) is bool
    # an on-by-default switch has its --no- form (`env_switch`)
    flag = (
        (f"`{flag_of(f)}, --no-{flag_of(f)[2:]}`" if switch and f.default else f"`{flag_of(f)}`")
        if meta.flag
        else ""
    )
    var = f"`{env_name(component_of(cls), flag_of(f))}`"
    if meta.fallback_env:
        var += f", else `{meta.fallback_env}`"
    if meta.shown_default:
        default = meta.shown_default
    elif f.default is None:
        default = ""
    else:
        default = _shown(f.default) if switch else f"`{_shown(f.default)}`"
    text = prefix + " ".join(meta.help.split()).replace("|", "\\|")
    return f"| {flag} | {var} | {default} | {text} |"
