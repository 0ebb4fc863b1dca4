"""What a local cluster asks its parts while it starts and watches them: is a part healthy, and which
backends does the master route to."""
from __future__ import annotations

import httpx


def healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def routable(client: httpx.Client, master: str) -> set[str]:
    try:
        view = client.get(f"http://{master}/backends").json()
        return {b["name"] for b in view["backends"] if b["healthy"]}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return set()
