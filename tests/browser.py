"""A headless Chromium driven over the DevTools protocol on a pipe (no WebDriver, no socket).

``chromium --remote-debugging-pipe`` reads protocol commands from file descriptor 3 and
writes replies and events to 4, each a JSON message ended by a NUL byte. A page loads with
every request paused first (``Fetch``): requests to ``serve`` URLs are answered from local
files, other remote requests are refused (the tests run without a network: a page's CDN
scripts would otherwise hang its load), and local ones go through.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time

#: The flags every run uses: headless, and nothing that reaches out or remembers.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--disable-dev-shm-usage", "--remote-debugging-pipe")


def chromium() -> str:
    """The Chromium executable (Debian's ``chromium``: ``make chromium`` installs it)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise RuntimeError("chromium is not installed: run `make chromium`")
    return path


class Browser:
    """One headless Chromium with a fresh profile in ``profile_dir``; a context manager."""

    def __init__(self, profile_dir: str, serve: dict = (), width: int = 1280, height: int = 900):
        self.serve = dict(serve)             # URL substring -> (local file, MIME type)
        import fcntl

        to_browser, self._out = os.pipe()
        self._in, from_browser = os.pipe()
        # Above 9 (bash takes any fd number), so the moves to 3 and 4 cannot overwrite one another.
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_browser, from_browser)]
        os.close(to_browser)
        os.close(from_browser)
        self.proc = subprocess.Popen(
            ["/bin/bash", "-c", f'exec "$@" 3<&{ends[0]} 4>&{ends[1]} {ends[0]}<&- {ends[1]}>&-',
             "sh", chromium(), *FLAGS, f"--user-data-dir={profile_dir}",
             f"--window-size={width},{height}", "about:blank"],
            pass_fds=ends, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for fd in ends:
            os.close(fd)
        self._buffer = b""
        self._ids = 0
        self._events: list = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        self.call("Page.enable", session=self.session)
        self.call("Fetch.enable", session=self.session, patterns=[{"urlPattern": "*"}])

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for fd in (self._out, self._in):
            try:
                os.close(fd)
            except OSError:
                pass
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    # ------------------------------------------------------------------ the protocol
    def call(self, method: str, session: str = None, timeout: float = 60, **params) -> dict:
        self._ids += 1
        ident = self._ids
        message = {"id": ident, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._next(deadline)
            if reply.get("id") == ident:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "id" not in reply:       # an event; a reply to a _send is dropped
                self._event(reply)

    def _next(self, deadline: float) -> dict:
        import select

        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise TimeoutError("no reply from chromium")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited ({self.proc.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _event(self, event: dict) -> None:
        if event.get("method") != "Fetch.requestPaused":
            self._events.append(event)
            return
        params = event["params"]
        url, request = params["request"]["url"], params["requestId"]
        local = next((found for part, found in self.serve.items() if part in url), None)
        if local is not None:
            path, mime = local
            with open(path, "rb") as fh:
                body = base64.b64encode(fh.read()).decode()
            self._send("Fetch.fulfillRequest", requestId=request, responseCode=200, body=body,
                       responseHeaders=[{"name": "Content-Type", "value": mime}])
        elif url.startswith(("http://127.0.0.1", "http://localhost", "about:", "data:")):
            self._send("Fetch.continueRequest", requestId=request)
        else:
            self._send("Fetch.failRequest", requestId=request, errorReason="BlockedByClient")

    def _send(self, method: str, **params) -> None:
        # A reply to a paused request: fire and forget (its own reply is read and dropped).
        self._ids += 1
        os.write(self._out, json.dumps({"id": self._ids, "method": method, "params": params,
                                        "sessionId": self.session}).encode() + b"\0")

    # ------------------------------------------------------------------ pages
    def load(self, url: str, timeout: float = 60) -> None:
        """Open ``url`` and wait for its load event."""
        self._events.clear()
        self.call("Page.navigate", session=self.session, url=url)
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self._events):
            message = self._next(deadline)
            if "id" not in message:
                self._event(message)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression on the page (JSON-able)."""
        result = self.call("Runtime.evaluate", session=self.session, expression=expression,
                           returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: str) -> None:
        """A PNG of the whole page."""
        height = self.evaluate("document.documentElement.scrollHeight")
        self.call("Emulation.setDeviceMetricsOverride", session=self.session, width=1280,
                  height=int(height), deviceScaleFactor=1, mobile=False)
        data = self.call("Page.captureScreenshot", session=self.session, format="png")["data"]
        with open(path, "wb") as fh:
            fh.write(base64.b64decode(data))
