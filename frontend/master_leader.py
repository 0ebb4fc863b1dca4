"""RTP-LLM's leader discovery: a frontend configured with any master of a group asks it `POST /rtp_llm/master`
and routes through the `real_master_host` it names (frontend/routing.py asks at the first request and again
after the master failed)."""
from __future__ import annotations

import httpx

from kvyard.cluster_auth import is_loopback


async def leader_of(client: httpx.AsyncClient) -> str | None:
    """The leader's host:port as `client`'s master names it; None when it cannot say, or names a loopback
    address that is not the one we were configured with (a master bound to 0.0.0.0 advertises 127.0.0.1
    unless ADVERTISE_HOST is set: following that from another machine would lose it)."""
    try:
        resp = await client.post("/rtp_llm/master", json={})
        host = resp.json().get("real_master_host") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    name, _, port = host.rpartition(":") if isinstance(host, str) else ("", "", "")
    if not name or not port.isdigit():
        return None
    if is_loopback(name) and not is_loopback(client.base_url.host):
        return None
    return host


def leader_url(configured: httpx.URL, leader: str) -> httpx.URL:
    """The configured master's URL (scheme, path) with the leader's host and port."""
    name, _, port = leader.rpartition(":")
    return configured.copy_with(host=name.strip("[]"), port=int(port))


async def answers(url: httpx.URL, timeout: httpx.Timeout) -> bool:
    """Whether anything answers HTTP at `url` (any status): a master that names an address where nobody
    listens (a wrong ADVERTISE_HOST) is not followed there."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
            await client.get("/health")
    except httpx.HTTPError:
        return False
    return True
