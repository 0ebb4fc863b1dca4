"""Backend → master: announce this backend (address, ports, model) every few seconds while it serves."""
from __future__ import annotations

import asyncio
import logging

import httpx

from backend.config import BackendConfig
from kvyard.cluster_auth import auth_headers

log = logging.getLogger("kvyard.backend")

REGISTER_INTERVAL_S = 2.0  # also how soon a restarted master relearns this backend


def registration_body(cfg: BackendConfig) -> dict[str, object]:
    # With a wildcard bind and no ADVERTISE_HOST the master uses the address the POST came from.
    host = cfg.advertise_host or ("" if cfg.host in ("0.0.0.0", "::") else cfg.host)
    return {"model": cfg.model_name, "role": cfg.role, "server_ip": host,
            "grpc_port": cfg.grpc_port, "http_port": cfg.http_port}


async def register_forever(cfg: BackendConfig) -> None:
    base = cfg.master_address if "://" in cfg.master_address else f"http://{cfg.master_address}"
    body = registration_body(cfg)
    registered = None  # None: not tried yet; then whether the last attempt worked (log changes only)
    async with httpx.AsyncClient(base_url=base, timeout=2.0, headers=auth_headers(cfg.cluster_token)) as client:
        while True:
            try:
                resp = await client.post("/rtp_llm/register", json=body)
                ok, why = resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text[:200]}"
            except httpx.HTTPError as exc:
                ok, why = False, repr(exc)
            if ok != registered:
                if ok:
                    log.info("registered with the master at %s as %s", base, body)
                else:
                    log.warning("cannot register with the master at %s (%s); retrying", base, why)
                registered = ok
            await asyncio.sleep(REGISTER_INTERVAL_S)
