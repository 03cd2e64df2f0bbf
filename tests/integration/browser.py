"""A page open in headless Chromium, read through the DevTools protocol over a pipe (no websocket client
and no browser driver needed): tests assert on the DOM as the page's own script left it."""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class HeadlessPage:
    """`url` in a fresh headless Chromium (its profile under `profile`), until `close()`.

    Chromium reads protocol messages on its fd 3 and writes on fd 4 (`--remote-debugging-pipe`), each
    a JSON object ended by a NUL byte. Its launcher is a shell script, so the pipe ends are moved to fds
    the script leaves alone and put in place by the `exec` that starts the browser itself."""

    def __init__(self, url: str, profile: Path):
        assert CHROMIUM is not None, "chromium is not installed"
        to_browser, self._to_browser = os.pipe()
        self._from_browser, from_browser = os.pipe()
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser, from_browser)]
        for fd in (to_browser, from_browser):
            os.close(fd)
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                f"--user-data-dir={profile}", url]
        script = f'exec "$0" "$@" 3<&{ends[0]} 4>&{ends[1]} {ends[0]}<&- {ends[1]}>&-'
        self.process = subprocess.Popen(["bash", "-c", script, CHROMIUM, *args], pass_fds=ends,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        for fd in ends:
            os.close(fd)
        self._buffer, self._next_id = b"", 0
        try:
            targets = self._call("Target.getTargets")["targetInfos"]
            page = next(t["targetId"] for t in targets if t["type"] == "page")
            self._session = self._call("Target.attachToTarget", {"targetId": page, "flatten": True})["sessionId"]
        except BaseException:
            self.close()
            raise

    def _call(self, method: str, params: dict | None = None, session: str | None = None,
              timeout: float = 30.0) -> dict[str, Any]:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply["result"]
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError(f"chromium did not answer {method} within {timeout:.0f}s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self._buffer += chunk

    def evaluate(self, expression: str) -> Any:
        """The value of a JS expression in the page (JSON-serializable results only)."""
        result = self._call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, self._session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float) -> Any:
        """The first truthy value of `expression`, polled until `timeout` seconds have passed."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{expression} still {value!r} after {timeout:.0f}s")
            time.sleep(0.3)

    def close(self) -> None:
        """Chromium and every process it started (they share its session)."""
        try:
            self._call("Browser.close", timeout=5.0)
            self.process.wait(timeout=10)
        except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
            pass  # killed below
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
