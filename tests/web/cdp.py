"""Headless Chromium driven over the DevTools protocol on a pipe
(`--remote-debugging-pipe`: commands on fd 3, answers on fd 4, each a JSON
object ended by a NUL byte): no browser download, no websocket library,
only Debian's `chromium`."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

CHROMIUM = os.environ.get("PAGEDKV_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


class ChromiumGone(RuntimeError):
    """The browser process is gone (its DevTools pipe closed)."""


def available() -> bool:
    return os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)


class Browser:
    # Chromium now and then dies while starting (seen once on a fresh CI
    # machine, right after `apt-get install chromium`): the first command
    # then meets a closed pipe. It is started again, with what it printed
    # kept for the error if it never comes up.
    START_ATTEMPTS = 3

    def __init__(self, width: int = 1280, height: int = 900) -> None:
        for attempt in range(1, self.START_ATTEMPTS + 1):
            self._start(width, height)
            try:
                target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)[
                    "targetId"
                ]
                break
            except (BrokenPipeError, ChromiumGone) as exc:
                log = self._stderr_tail()
                self.close()
                if attempt == self.START_ATTEMPTS:
                    raise ChromiumGone(
                        f"chromium did not start ({attempt} attempts): {exc}; it said: {log}"
                    ) from exc
                time.sleep(1.0)
        self.session = self.send(
            "Target.attachToTarget", {"targetId": target, "flatten": True}, session=False
        )["sessionId"]
        self.send("Page.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    def _start(self, width: int, height: int) -> None:
        self._dir = tempfile.mkdtemp(prefix="pagedkv-chromium-")
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        # Out of the way of fds 3 and 4, which the child gets.
        hi = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_child_r, from_child_w)]
        for fd in (to_child_r, from_child_w):
            os.close(fd)

        def child_fds() -> None:
            os.dup2(hi[0], 3)
            os.dup2(hi[1], 4)

        self._stderr = os.path.join(self._dir, "stderr.log")
        with open(self._stderr, "wb") as err:
            self.proc = subprocess.Popen(
                [
                    CHROMIUM,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-background-networking",
                    "--disable-dev-shm-usage",
                    "--no-first-run",
                    "--remote-debugging-pipe",
                    f"--user-data-dir={self._dir}",
                    f"--window-size={width},{height}",
                    "about:blank",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                preexec_fn=child_fds,
                pass_fds=(3, 4),
            )
        for fd in hi:
            os.close(fd)
        self._w, self._r = to_child_w, from_child_r
        self._buf = b""
        self._id = 0
        self.session: str | None = None

    def _stderr_tail(self) -> str:
        try:
            with open(self._stderr, "rb") as f:
                return f.read()[-2000:].decode(errors="replace").strip() or "(nothing)"
        except OSError:
            return "(no log)"

    def send(
        self, method: str, params: dict | None = None, session: bool = True, timeout: float = 30.0
    ) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._id:
                    if "error" in answer:
                        raise RuntimeError(f"{method}: {answer['error']}")
                    return answer["result"]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{method}: no answer in {timeout} s")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise ChromiumGone("chromium closed the pipe")
            self._buf += chunk

    def goto(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete'")

    def eval(self, expression: str) -> Any:
        r = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 10.0, interval: float = 0.05) -> float:
        """Seconds until `expression` is truthy; TimeoutError after `timeout`."""
        start = time.monotonic()
        while True:
            if self.eval(f"!!({expression})"):
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"not true after {timeout} s: {expression}")
            time.sleep(interval)

    def screenshot(self, path: str, full_page: bool = True) -> None:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
            h = self.eval("document.documentElement.scrollHeight")
            w = self.eval("document.documentElement.scrollWidth")
            params["clip"] = {"x": 0, "y": 0, "width": w, "height": h, "scale": 1}
        with open(path, "wb") as f:
            f.write(base64.b64decode(self.send("Page.captureScreenshot", params)["data"]))

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False, timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._w, self._r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
