"""Start an allocator server or a private redis-server as a child process.

Used by the benchmark and the tests (`tests/support/allocator.py`): both want a
REAL server process (its own interpreter, GIL and sockets, killable with
SIGKILL) rather than a server thread inside the caller.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

LISTENING = re.compile(r"listening on (\S+):(\d+) ")
METRICS = re.compile(r"metrics on (http://\S+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m allocator_service --listen HOST:PORT ARGS...`, started and
    waited for (it prints its address once it serves)."""

    def __init__(
        self,
        args: tuple[str, ...] | list[str] = (),
        *,
        listen: str = "127.0.0.1:0",
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 30.0,
    ) -> None:
        cmd = [sys.executable, "-m", "allocator_service", "--listen", listen, *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, env=full_env,
        )
        self.log: deque[str] = deque(maxlen=500)
        self.metrics_url: str | None = None
        ready = threading.Event()
        found: list[tuple[str, int]] = []

        def drain() -> None:
            # Keep reading so a chatty server never blocks on a full pipe.
            for line in self.proc.stderr:
                self.log.append(line.rstrip())
                if (m := METRICS.search(line)) is not None:
                    self.metrics_url = m.group(1)
                if not found and (m := LISTENING.search(line)) is not None:
                    found.append((m.group(1), int(m.group(2))))
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(startup_timeout_s) or not found:
            self.kill()
            raise RuntimeError("allocator server did not start:\n" + "\n".join(self.log))
        self.host, self.port = found[0]
        self.address = f"{self.host}:{self.port}"

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs (a crash)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def terminate(self, timeout_s: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.terminate()
        except subprocess.TimeoutExpired:
            pass


class RedisProcess:
    """A private `redis-server` on a free port, with its own directory and
    append-only persistence (as a production journal store would run)."""

    def __init__(self, startup_timeout_s: float = 15.0) -> None:
        self.dir = tempfile.mkdtemp(prefix="pagedkv-redis-")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.startup_timeout_s = startup_timeout_s
        self.start()

    def start(self) -> None:
        """(Re)start on the same port and directory: what it persisted
        (append-only file) is loaded again."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not installed")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
             "--save", "", "--appendonly", "yes", "--daemonize", "no"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def halt(self) -> None:
        """Stop the server (SIGTERM: it flushes its append-only file) but
        keep its directory, so `start()` brings the same data back."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stop(self) -> None:
        self.halt()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
