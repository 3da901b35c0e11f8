"""The configuration reference in docs/operations.md: generated from the parsers, never stale."""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from pagedkv.cli import build_parser
from pagedkv.tools.config_reference import BEGIN, END, reference

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"


def tool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedkv.tools.config_reference", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def sections(text: str) -> dict[str, str]:
    """`pagedkv worker` -> the rows of its table."""
    parts = re.split(r"^### `([^`]+)`$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def row(section: str, flag: str) -> list[str]:
    [line] = [line for line in section.splitlines() if line.startswith(f"| `{flag}")]
    return [cell.strip() for cell in line.strip("|").split(" | ")]


def test_the_reference_in_operations_md_is_current():
    # whatever the caller's environment says, the reference shows the built-in defaults
    done = tool(
        "--check", str(OPERATIONS), env={"PAGEDKV_WORKER_MODEL": "elsewhere", "VLLM_API_KEY": "k"}
    )
    assert done.returncode == 0, done.stderr


def test_a_stale_reference_is_found_and_written_again(tmp_path):
    good = OPERATIONS.read_text()
    stale = tmp_path / "operations.md"
    head, rest = good.split(BEGIN)
    stale.write_text(head + BEGIN + rest.replace("| `--metrics-port` |", "| `--gone` |", 1))
    done = tool("--check", str(stale))
    assert done.returncode == 1 and "--write" in done.stderr
    assert tool("--write", str(stale)).returncode == 0
    assert stale.read_text() == good  # the text around the markers is kept as it was
    assert tool("--check", str(stale)).returncode == 0


def test_a_file_without_the_markers_is_an_error(tmp_path):
    plain = tmp_path / "plain.md"
    plain.write_text("# nothing to fill\n")
    done = tool("--check", str(plain))
    assert done.returncode == 2 and BEGIN in done.stderr and END in done.stderr


def test_every_flag_of_every_command_has_a_row():
    tables = sections(reference())
    commands = 0

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        nonlocal commands
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for action in subs:
            for sub_name, sub in action.choices.items():
                walk(sub, f"{name} {sub_name}")
        if subs:
            return
        commands += 1
        flags = [
            s
            for a in parser._actions
            if not isinstance(a, argparse._HelpAction)
            for s in a.option_strings
        ]
        for flag in flags:
            assert re.search(rf"^\| `[^`]*{re.escape(flag)}\b", tables[name], flags=re.M), (
                name,
                flag,
            )

    walk(build_parser(), "pagedkv")
    assert commands == len(tables) and {
        "pagedkv allocator",
        "pagedkv worker",
        "pagedkv router",
        "pagedkv up",
    } <= set(tables)


def test_rows_give_the_variable_and_the_default_a_user_gets():
    text = reference()
    tables = sections(text)
    assert row(tables["pagedkv allocator"], "--metrics-port")[1:3] == [
        "`PAGEDKV_ALLOCATOR_METRICS_PORT`",
        "",
    ]
    assert row(tables["pagedkv allocator"], "--state")[1:3] == [
        "`PAGEDKV_ALLOCATOR_STATE`",
        "`memory`",
    ]
    assert row(tables["pagedkv worker"], "--enable-prefix-caching")[1:3] == [
        "`PAGEDKV_WORKER_ENABLE_PREFIX_CACHING`",
        "on",
    ]
    assert row(tables["pagedkv router"], "--policy")[1:3] == ["`PAGEDKV_ROUTER_POLICY`", "`kv`"]
    assert row(tables["pagedkv up"], "--workers")[1:3] == ["`PAGEDKV_UP_WORKERS`", "`2`"]
    # a setting that is a variable only has a row too
    assert "`PAGEDKV_ALLOCATOR_FAIR_SHARE_WINDOW_MS`" in tables["pagedkv allocator"]
    # the worker's default id is made per process: the reference names no host or pid
    assert (
        row(tables["pagedkv worker"], "--worker-id")[2]
        == "HOSTNAME-PID-RANDOM (unique per host and process)"
    )
    assert not re.search(rf"{re.escape(socket.gethostname()[:100])}-\d+-[0-9a-f]{{6}}", text)
