"""One child process, and stopping and waiting for several.

A `Process` runs in its own session (a Ctrl-C reaches only the launcher, which
stops its children in order, and a SIGKILL of the group also reaches
grandchildren); its output is kept (the last lines in memory, all of it in a
log file when given) and optionally echoed with a coloured name prefix. With
`die_with_parent` (Linux) it is also told to die with the *thread* that
started it, so even a killed launcher leaves no orphans: start such processes
from a thread that outlives them (normally the main thread).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from pagedkv_base.settings import CliError

# Run a command with PR_SET_PDEATHSIG (1) = SIGTERM, so it dies with the launcher.
_EXEC_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)

# Access-log lines of health probes and scrapes: kept in the log file, not echoed.
_QUIET_LINE = re.compile(r'"GET /(health|metrics) HTTP/')


class StackError(CliError):
    """A process of the stack failed to start or died; the message names it."""


class Process:
    """One child process: own session, output kept (tail + log file) and optionally echoed."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path | None,
        colour: str = "cyan",
        console=None,
        env: dict[str, str] | None = None,
        tail_lines: int = 40,
        *,
        die_with_parent: bool = True,
        append: bool = False,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self._console = console
        self._colour = colour
        self._on_line = on_line
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        launch = self.argv
        if die_with_parent and sys.platform.startswith("linux"):
            launch = [sys.executable, "-c", _EXEC_WITH_PARENT, str(os.getpid()), *self.argv]
        self._log = None
        if log_path is not None:
            self._log = open(log_path, "a" if append else "w", encoding="utf-8", buffering=1)  # noqa: SIM115 - closed by the reader
        try:
            self.popen = subprocess.Popen(
                launch,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=full_env,
            )
        except OSError:
            if self._log is not None:
                self._log.close()
            raise
        self._reader = threading.Thread(target=self._read, name=f"log-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        # Keep reading so a chatty process never blocks on a full pipe.
        assert self.popen.stdout is not None
        try:
            for raw in iter(self.popen.stdout.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                self.tail.append(line)
                if self._log is not None:
                    self._log.write(line + "\n")
                if self._on_line is not None:
                    self._on_line(line)
                if self._console is not None and not _QUIET_LINE.search(line):
                    from rich.text import Text

                    self._console.print(
                        Text.assemble((f"{self.name:>10} | ", self._colour), line),
                        markup=False,
                        highlight=False,
                        soft_wrap=True,
                    )
        finally:
            self.popen.stdout.close()
            if self._log is not None:
                self._log.close()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the whole group: no shutdown code runs (a crash)."""
        self.signal_group(signal.SIGKILL)
        self.popen.wait()
        self.finish()

    def exit_status(self) -> str:
        """How it ended, in words: `status 3`, `SIGKILL`."""
        code = self.popen.returncode
        if code is not None and code < 0:
            try:
                return signal.Signals(-code).name
            except ValueError:
                return f"signal {-code}"
        return f"status {code}"

    def describe_failure(self, what: str) -> str:
        self._reader.join(timeout=1.0)  # let the last lines arrive
        lines = "\n".join(f"    {line}" for line in list(self.tail)[-20:]) or "    (no output)"
        where = f" ({self.log_path})" if self.log_path is not None else ""
        return f"{self.name} {what}; its last lines{where}:\n{lines}"

    def finish(self) -> None:
        self._reader.join(timeout=2.0)


def stop_processes(
    tiers: Sequence[Sequence[Process]], grace: float, hurry: threading.Event | None = None
) -> None:
    """SIGTERM each tier's process groups, SIGKILL what outlives `grace` seconds, tier by tier."""
    hurry = hurry or threading.Event()
    for tier in tiers:
        for p in tier:
            if p.alive():
                p.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        try:
            while (
                any(p.alive() for p in tier) and time.monotonic() < deadline and not hurry.is_set()
            ):
                time.sleep(0.05)
        except KeyboardInterrupt:
            hurry.set()
        for p in tier:
            p.signal_group(signal.SIGKILL)  # also reaches grandchildren left in the group
            p.popen.wait()
            p.finish()


def wait_healthy(
    checks: Sequence[tuple[Process, Callable[[], bool]]], timeout: float, interval: float = 0.2
) -> None:
    """Wait until every check passes; StackError names a process that died or never got healthy."""
    pending = list(checks)
    deadline = time.monotonic() + timeout
    while pending:
        for proc, check in list(pending):
            if not proc.alive():
                raise StackError(
                    proc.describe_failure(
                        f"exited with status {proc.popen.returncode} before it was healthy"
                    )
                )
            if check():
                pending.remove((proc, check))
        if not pending:
            return
        if time.monotonic() > deadline:
            raise StackError(
                "\n".join(
                    p.describe_failure(f"was not healthy after {timeout:g} s") for p, _ in pending
                )
            )
        time.sleep(interval)
