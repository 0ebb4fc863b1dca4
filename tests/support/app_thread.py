"""An ASGI app served by uvicorn on a free loopback port, on its own thread (in-process frontends, gateways
and fake upstreams in tests)."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import uvicorn

from tests.support.procs import free_port_block


class AppThread:
    """Serves an ASGI app with uvicorn on `port` or a free loopback port, on its own thread."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port_block(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan="on"))
        self._server.install_signal_handlers = lambda: None  # not the main thread
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve()), daemon=True)

    def __enter__(self) -> AppThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the app did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def kill(self) -> None:
        """Stop at once, as a crashed server would: streams in flight are cut, not finished."""
        self._server.force_exit = True
        self.__exit__(None, None, None)
