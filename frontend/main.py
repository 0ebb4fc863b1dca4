"""Frontend role start-up: tokenizer and renderer (no weights), then uvicorn on START_PORT until SIGTERM,
which drains: new generation requests and health get 503, requests in flight finish (DRAIN_GRACE_S at
most), then the server stops. A second signal stops it at once."""
from __future__ import annotations

import logging
import time
from types import FrameType

import uvicorn

from frontend.admission import Admission
from frontend.app import create_app
from frontend.config import FrontendConfig
from kvyard.tokenizer import TextTokenizer

log = logging.getLogger("kvyard.frontend")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission: Admission, grace_s: float) -> None:
        super().__init__(config)
        self.admission = admission
        self.grace_s = grace_s
        self._deadline = 0.0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.admission.draining:
            super().handle_exit(sig, frame)   # the second signal: stop now
            return
        log.info("signal %d: draining, %d requests in flight, up to %.0f s", sig, self.admission.in_flight,
                 self.grace_s)
        self.admission.start_draining()
        self._deadline = time.monotonic() + self.grace_s

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop calls this every 0.1 s.
        if self.admission.draining and not self.should_exit:
            if self.admission.in_flight == 0 or time.monotonic() >= self._deadline:
                self.should_exit = True
        return await super().on_tick(counter)


async def serve_frontend(cfg: FrontendConfig) -> None:
    tokenizer = TextTokenizer.from_path(cfg.tokenizer_path)
    admission = Admission(cfg)
    app = create_app(cfg, tokenizer, admission)
    server = DrainingServer(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=5),
                            admission, cfg.drain_grace_s)
    log.info("frontend serving %s on http://%s:%d (backend %s)", cfg.model_name, cfg.host, cfg.port,
             cfg.backend_address)
    await server.serve()
