"""One definition per component's configuration (`pagedkv_base.config`): the flags,
the environment variables and the reference all come from the dataclass."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv_base.config import (
    add_arguments,
    from_args,
    handed_on,
    name_of,
    reference_markdown,
    setting,
    to_argv,
)
from pagedkv_base.settings import CliError, seconds


@dataclass(frozen=True, slots=True)
class Toy:
    component: ClassVar[str] = "toy"

    size: int = setting(4, "blocks", stack=True)
    name: str | None = setting(None, "a name")
    caching: bool = setting(True, "a toggle", stack=True)
    verbose: bool = setting(False, "a switch")
    wait: float = setting(1.0, "seconds to wait", parse=seconds, flag=False)
    mode: str = setting("fast", "how to go", choices=("fast", "slow"), flag=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("size must be positive")


def parser(passthrough: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p, Toy, passthrough=passthrough)
    return p


def test_defaults_flags_and_variables(monkeypatch):
    assert from_args(Toy, parser().parse_args([])) == Toy()
    monkeypatch.setenv("PAGEDKV_TOY_SIZE", "8")
    monkeypatch.setenv("PAGEDKV_TOY_CACHING", "off")
    assert from_args(Toy, parser().parse_args([])) == Toy(size=8, caching=False)
    # a flag wins over its variable
    assert from_args(Toy, parser().parse_args(["--size", "9", "--caching"])) == Toy(size=9)


def test_a_bad_variable_is_named(monkeypatch, capsys):
    monkeypatch.setenv("PAGEDKV_TOY_SIZE", "many")
    with pytest.raises(SystemExit):
        parser().parse_args([])
    assert "PAGEDKV_TOY_SIZE='many'" in capsys.readouterr().err
    monkeypatch.setenv("PAGEDKV_TOY_SIZE", "0")
    with pytest.raises(CliError, match="size must be positive"):
        from_args(Toy, parser().parse_args([]))


def test_a_setting_without_a_flag_is_its_variable(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--wait", "2"])
    monkeypatch.setenv("PAGEDKV_TOY_WAIT", "2.5")
    assert from_args(Toy, parser().parse_args([])).wait == 2.5
    monkeypatch.setenv("PAGEDKV_TOY_WAIT", "-1")
    with pytest.raises(CliError, match="PAGEDKV_TOY_WAIT='-1'"):
        from_args(Toy, parser().parse_args([]))
    monkeypatch.delenv("PAGEDKV_TOY_WAIT")
    monkeypatch.setenv("PAGEDKV_TOY_MODE", "slow")
    assert from_args(Toy, parser().parse_args([])).mode == "slow"
    monkeypatch.setenv("PAGEDKV_TOY_MODE", "sideways")  # its choices hold for the variable too
    with pytest.raises(CliError, match="PAGEDKV_TOY_MODE='sideways': expected one of fast, slow"):
        from_args(Toy, parser().parse_args([]))


def test_a_message_names_a_setting_as_a_user_gives_it():
    assert name_of(Toy, "size") == "--size" and name_of(Toy, "wait") == "PAGEDKV_TOY_WAIT"


@given(
    size=st.one_of(st.none(), st.integers(1, 10**6)), caching=st.one_of(st.none(), st.booleans())
)
def test_a_launcher_hands_on_what_it_was_given(size, caching):
    argv = ([] if size is None else ["--size", str(size)]) + (
        [] if caching is None else ["--caching" if caching else "--no-caching"]
    )
    handed = to_argv(Toy, parser(passthrough=True).parse_args(argv))
    assert set(handed) == set(argv)
    # the process makes of them what it would make of the flags themselves
    assert from_args(Toy, parser().parse_args(handed)) == from_args(Toy, parser().parse_args(argv))


def test_a_launcher_offers_only_stack_settings():
    flags = {s for a in parser(passthrough=True)._actions for s in a.option_strings}
    assert flags == {"-h", "--help", "--size", "--caching", "--no-caching"}


def test_reference_has_every_setting():
    table = reference_markdown(Toy).splitlines()
    assert len(table) == 2 + 6
    assert "| `--size` | `PAGEDKV_TOY_SIZE` | `4` | blocks |" in table
    assert "|  | `PAGEDKV_TOY_WAIT` | `1.0` | seconds to wait |" in table


@pytest.mark.parametrize("component", ["allocator", "worker", "router", "up"])
def test_each_component_is_its_dataclass(component):
    """A component's parser has exactly the flags of its dataclass, each with its
    variable in the help, and the reference names every setting."""
    import dataclasses

    from pagedkv.cli import build_parser
    from pagedkv.configs import CONFIGS, reference_markdown

    cls = CONFIGS[component]
    sub = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices[component]
    own = {a.dest: a for a in sub._actions if a.option_strings and a.dest != "help"}
    fields = dataclasses.fields(cls)
    flagged = {f.name for f in fields if f.metadata["pagedkv"].flag}
    handed = [
        (c, f) for c in handed_on(cls) for f in dataclasses.fields(c) if f.metadata["pagedkv"].stack
    ]
    assert bool(handed) is (component == "up")  # `up` hands the workers' and the router's on
    assert set(own) == flagged | {f.name for _, f in handed}
    for name, action in own.items():
        assert f"PAGEDKV_{component.upper()}_" in action.help or name not in flagged
    table = reference_markdown(component)
    for f in fields:
        assert f"`PAGEDKV_{component.upper()}_{f.name.upper()}`" in table
    for c, f in handed:  # with the variable that the process it is handed to reads
        flag = "--" + f.name.replace("_", "-")
        assert f"| `{flag}` | `PAGEDKV_{c.component.upper()}_{f.name.upper()}` |" in table


def test_a_worker_refuses_two_pool_sizes():
    from worker.cli import add_arguments as worker_arguments
    from worker.cli import worker_args

    p = argparse.ArgumentParser()
    worker_arguments(p)
    with pytest.raises(CliError, match="--num-blocks or --kv-cache-memory"):
        worker_args(p.parse_args(["--num-blocks", "8", "--kv-cache-memory", "1GiB"]))
