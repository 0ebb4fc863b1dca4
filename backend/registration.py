"""Backend → master: announce this backend (address, ports, model) every few seconds while it serves."""
from __future__ import annotations

import asyncio
import logging

import httpx

from backend.config import BackendConfig
from kvyard.cluster_auth import auth_headers

log = logging.getLogger("kvyard.backend")

REGISTER_INTERVAL_S = 2.0  # also how soon a restarted master relearns this backend
UNREACHABLE_AFTER = 3      # answers in a row saying the master's polls of us fail before we warn (~6 s)


def registration_body(cfg: BackendConfig) -> dict[str, object]:
    # With a wildcard bind and no ADVERTISE_HOST the master uses the address the POST came from.
    host = cfg.advertise_host or ("" if cfg.host in ("0.0.0.0", "::") else cfg.host)
    return {"model": cfg.model_name, "role": cfg.role, "server_ip": host,
            "grpc_port": cfg.grpc_port, "http_port": cfg.http_port}


class Reachability:
    """Whether the master can dial the address we registered, from its register answers ("healthy" and
    "error": what its status polls of that address found). A wrong ADVERTISE_HOST (or a peer address the
    master cannot route back to) registers fine and then fails every poll: say so, once per change."""

    def __init__(self) -> None:
        self.failing = 0  # answers in a row with a poll error
        self.warned = False

    def update(self, answer: object) -> str | None:
        """A log line when the verdict changes, else None."""
        if not isinstance(answer, dict) or "healthy" not in answer:
            return None  # an older master, or a registration that failed
        error = answer.get("error")
        self.failing = self.failing + 1 if not answer["healthy"] and error else 0
        if self.failing >= UNREACHABLE_AFTER and not self.warned:
            self.warned = True
            return (f"the master cannot reach this backend at {answer.get('name')} ({error}): set "
                    "ADVERTISE_HOST to an address the master and frontends can dial; no request is routed here")
        if self.warned and answer["healthy"]:
            self.warned = False
            return f"the master reaches this backend at {answer.get('name')} again"
        return None


async def register_forever(cfg: BackendConfig) -> None:
    base = cfg.master_address if "://" in cfg.master_address else f"http://{cfg.master_address}"
    body = registration_body(cfg)
    registered = None  # None: not tried yet; then whether the last attempt worked (log changes only)
    reachability = Reachability()
    async with httpx.AsyncClient(base_url=base, timeout=2.0, headers=auth_headers(cfg.cluster_token)) as client:
        while True:
            answer: object = None
            try:
                resp = await client.post("/rtp_llm/register", json=body)
                ok, why = resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text[:200]}"
                answer = resp.json() if ok else None
            except (httpx.HTTPError, ValueError) as exc:
                ok, why = False, repr(exc)
            if ok != registered:
                if ok:
                    log.info("registered with the master at %s as %s", base, body)
                else:
                    log.warning("cannot register with the master at %s (%s); retrying", base, why)
                registered = ok
            verdict = reachability.update(answer)
            if verdict is not None:
                (log.warning if reachability.warned else log.info)(verdict)
            await asyncio.sleep(REGISTER_INTERVAL_S)
