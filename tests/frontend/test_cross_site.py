"""A web page on another origin cannot drive a local kvyard (no CORS policy by default): its form POSTs,
`text/plain` fetches and WebSocket handshakes carry an Origin header and are refused; curl and the SDKs
(no Origin) are untouched; CORS_ALLOW_ORIGINS opens the API to the origins it names."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import websockets.sync.client as ws_client
from websockets.exceptions import InvalidStatus

from backend.mock_backend import MockScript
from kvyard.tokenizer import TextTokenizer
from tests.support.mock_stack import MockBackendThread, mock_frontend

BODY = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}'


@pytest.fixture(scope="module")
def mock(tokenizer: TextTokenizer) -> Iterator[MockBackendThread]:
    with MockBackendThread(MockScript((*tokenizer.encode("Hello"), 2))) as backend:
        yield backend


@pytest.mark.parametrize("ctype", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data",
                                   "application/json"])
def test_cross_site_posts_are_refused(tokenizer: TextTokenizer, mock: MockBackendThread, ctype: str) -> None:
    with mock_frontend(tokenizer, mock.address) as front:
        resp = httpx.post(f"{front.url}/v1/chat/completions", content=BODY,
                          headers={"content-type": ctype, "origin": "https://evil.example"})
        assert resp.status_code == 403
        assert resp.json()["error"]["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in resp.headers
        # curl -d (a form content type, no Origin) still works
        ok = httpx.post(f"{front.url}/v1/chat/completions", content=BODY,
                        headers={"content-type": "application/x-www-form-urlencoded"})
        assert ok.status_code == 200, ok.text
        assert httpx.get(f"{front.url}/health", headers={"origin": "https://evil.example"}).status_code == 200


def test_cross_site_websocket_is_refused(tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    with mock_frontend(tokenizer, mock.address) as front:
        url = front.url.replace("http://", "ws://") + "/lmtp"
        with pytest.raises(InvalidStatus) as exc:
            ws_client.connect(url, origin="https://evil.example", open_timeout=5)  # type: ignore[arg-type]
        assert exc.value.response.status_code == 403
        with ws_client.connect(url, open_timeout=5):  # no Origin: an LMQL client
            pass


def test_allowed_origins(tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    with mock_frontend(tokenizer, mock.address, CORS_ALLOW_ORIGINS="https://app.example") as front:
        pre = httpx.options(f"{front.url}/v1/chat/completions",
                            headers={"origin": "https://app.example", "access-control-request-method": "POST",
                                     "access-control-request-headers": "content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        resp = httpx.post(f"{front.url}/v1/chat/completions", content=BODY,
                          headers={"content-type": "application/json", "origin": "https://app.example"})
        assert resp.status_code == 200, resp.text
        assert resp.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.post(f"{front.url}/v1/chat/completions", content=BODY,
                           headers={"content-type": "application/json", "origin": "https://evil.example"})
        assert other.status_code == 403
