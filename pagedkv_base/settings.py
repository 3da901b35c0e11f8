"""One configuration scheme for every command (the bottom layer: imports nothing of the project).
`pagedkv_base.config` makes a component's flags, variables and reference from
its config dataclass with these pieces.

- Every flag `--FLAG` of a component (`allocator`, `worker`) can be given as the
  environment variable `PAGEDKV_<COMPONENT>_<FLAG>` (`--metrics-port` of the
  allocator: `PAGEDKV_ALLOCATOR_METRICS_PORT`); a flag on the command line wins.
  `env_default` and `env_switch` make those argparse defaults. A variable is
  parsed like the flag's value, when the command runs (so a bad variable of one
  command never breaks another), and a bad one is a usage error naming it.
- Booleans from the environment are strict: 1/true/yes/on or 0/false/no/off.
- `LOG_LEVELS` / `log_level`: one log-level type, any case, for every command;
  `seconds`: one type for a positive number of seconds.
- `parse_threads` / `thread_share`: a thread count or a share of the cores
  ("1/2"), the one rule by which a launcher divides a machine among workers.
- `read_secret` / `read_file`: the one way to read a token or a certificate.
- `CliError` is the one user-facing error; `run_command` prints it as
  `pagedkv COMMAND: error: MESSAGE` with exit status 2 (never a traceback), and
  ends quietly when the reader of stdout goes away (`... | head`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2, no traceback."""


def env_name(component: str, flag: str) -> str:
    """`env_name("worker", "--max-model-len")` -> "PAGEDKV_WORKER_MAX_MODEL_LEN"."""
    return f"PAGEDKV_{component}_{flag.lstrip('-')}".upper().replace("-", "_")


class EnvValue(str):
    """A default that came from the environment: remembers its variable, so a
    bad value is reported by the variable's name rather than the flag's."""

    variable: str

    def __new__(cls, value: str, variable: str) -> EnvValue:
        self = super().__new__(cls, value)
        self.variable = variable
        return self


def from_env(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """`convert` for argparse, naming the variable when an environment default is bad.

    argparse parses a string default with the flag's `type` only when the flag
    is not given, so the variable is read exactly when it is used."""

    def parse(text: str) -> Any:
        try:
            value = convert(str(text))
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            if isinstance(text, EnvValue):
                reason = (
                    str(exc)
                    if isinstance(exc, argparse.ArgumentTypeError)
                    else f"not a valid {convert.__name__}"
                )
                raise argparse.ArgumentTypeError(
                    f"{text.variable}={str(text)!r}: {reason}"
                ) from None
            raise
        return value

    # argparse names the type in its message ("invalid int value: 'x'"): keep that for flags.
    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def env_default(
    component: str, flag: str, default: Any = None, type: Callable[[str], Any] = str
) -> dict[str, Any]:
    """argparse keywords (`default`, `type`) for `--FLAG`: `$PAGEDKV_<COMPONENT>_<FLAG>`
    when set, else `default`; either way parsed by `type`."""
    name = env_name(component, flag)
    raw = os.environ.get(name)
    return {"default": default if raw is None else EnvValue(raw, name), "type": from_env(type)}


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(
        f"not a boolean (use {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)})"
    )


parse_bool.__name__ = "boolean"


class _Switch(argparse.Action):
    """`store_true` whose default may come from the environment (parsed strictly)."""

    def __init__(self, option_strings, dest, default=False, **kwargs) -> None:
        super().__init__(
            option_strings, dest, nargs=0, default=default, type=from_env(parse_bool), **kwargs
        )

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, True)


class _Toggle(argparse.BooleanOptionalAction):
    """`--FLAG` / `--no-FLAG` whose default may come from the environment (parsed strictly)."""

    def __init__(self, option_strings, dest, default=None, **kwargs) -> None:
        super().__init__(option_strings, dest, default=default, **kwargs)
        self.type = from_env(parse_bool)  # set here: BooleanOptionalAction(type=) is deprecated


def env_switch(component: str, flag: str, default: bool = False) -> dict[str, Any]:
    """argparse keywords for an on/off `--FLAG`: its variable when set, else `default`.

    Off by default: a plain switch. On by default: `--FLAG` and `--no-FLAG`
    (argparse.BooleanOptionalAction), so the flag can be turned off."""
    name = env_name(component, flag)
    raw = os.environ.get(name)
    value = default if raw is None else EnvValue(raw, name)
    return {"action": _Toggle if default else _Switch, "default": value}


def log_level(text: str) -> str:
    """A log level in any case ("info", "INFO"), as logging wants it (upper case)."""
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"not a log level (one of {', '.join(LOG_LEVELS)}, any case)"
        )
    return level


log_level.__name__ = "log level"


def gib_or_none(text: str) -> float:
    """A size in GiB >= 0 ('none': 0)."""
    if text.strip().lower() == "none":
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of GiB >= 0 or 'none', got {text!r}")
    return value


def seconds(text: str) -> float:
    """A positive, finite number of seconds (a timeout, an interval)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def cpu_count() -> int:
    """The cores this process may run on: its affinity mask (a container's cpuset), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def thread_share(workers: int) -> str:
    """What a launcher passes each of `workers` workers on one machine as `--threads`:
    "1/N", which each worker resolves against its own cores (`parse_threads`)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return f"1/{workers}"


def parse_threads(text: str, cores: int | None = None) -> int:
    """`--threads`: a count ("4") or a share of the cores ("1/2": half of them).

    A share is `max(1, cores * A // B)` for "A/B", so N workers started with
    "1/N" each take `max(1, cores // N)` and together no more than the machine
    (unless there are more workers than cores: then each gets one).
    """
    word = text.strip()
    try:
        if "/" in word:
            a, b = (int(x) for x in word.split("/", 1))
            if not 0 < a <= b:
                raise ValueError
            return max(1, (cpu_count() if cores is None else cores) * a // b)
        value = int(word)
        if value < 1:
            raise ValueError
        return value
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a thread count (e.g. 4) or a share of the cores (e.g. 1/2), got {text!r}"
        ) from None


parse_threads.__name__ = "threads"


def read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise CliError(f"cannot read {what} {path}: {exc.strerror}") from None


def read_secret(path: str, what: str = "token file") -> str:
    """The secret in file `path`, without surrounding white space; never empty."""
    try:
        secret = read_file(path, what).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CliError(f"{what} {path} is not UTF-8 text") from None
    if not secret:
        raise CliError(f"{what} {path} is empty")
    return secret


def run_command(
    command: str, run: Callable[[argparse.Namespace], int | None], args: argparse.Namespace
) -> int:
    """`run(args)`, with the one error style of every command; returns the exit status."""
    try:
        status = int(run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows up here at the latest, while we still catch it
        return status
    except CliError as exc:
        print(f"pagedkv {command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`pagedkv replay ... | head -1`): stop quietly, as
        # a command killed by SIGPIPE would, and keep the interpreter's final
        # flush from writing to the closed pipe again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
