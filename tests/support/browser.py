"""Headless Chromium (Debian's package) driven over the DevTools protocol: load a page, evaluate JavaScript in
it, take a screenshot. No driver beyond the `websockets` package; the browser always stops."""
from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

from tests.support.procs import free_port_block, stop_groups

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


class Browser:
    """One headless Chromium with one page. Use as a context manager."""

    def __init__(self, url: str, width: int = 1400, height: int = 900) -> None:
        exe = chromium_path()
        if exe is None:
            raise RuntimeError("no Chromium found (apt-get install -y chromium)")
        self._profile = tempfile.TemporaryDirectory(prefix="kvyard-chromium-")
        self.port = free_port_block(1)
        # The flags keep it from calling out (this machine has no network) and from needing a sandbox as root.
        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={self._profile.name}",
             f"--remote-debugging-port={self.port}", "--remote-debugging-address=127.0.0.1",
             f"--window-size={width},{height}", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self._ids = itertools.count(1)
        self._ws: ClientConnection | None = None

    def __enter__(self) -> Browser:
        try:
            self._ws = connect(self._page_ws_url(), max_size=64 * 1024 * 1024).__enter__()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _page_ws_url(self, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            try:
                pages = [t for t in httpx.get(f"http://127.0.0.1:{self.port}/json/list", timeout=1).json()
                         if t.get("type") == "page"]
                if pages:
                    return str(pages[0]["webSocketDebuggerUrl"])
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError("chromium's DevTools endpoint did not come up")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv(timeout=30))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 20.0) -> Any:
        """Polls until `expression` is truthy; returns its value."""
        deadline = time.monotonic() + timeout_s
        value: Any = None
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"{expression!r} stayed {value!r} for {timeout_s} s")

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None
        stop_groups([self.proc], grace_s=10)  # its renderers share its process group
        self._profile.cleanup()
