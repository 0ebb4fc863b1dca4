"""A loopback HTTP server for image-fetch tests: /ok.png (a PNG), /page (text/html), /big.png (a PNG larger
than the tests' cap), /slow.png (answers after 5 s), /redirect-private (to a private address), /redirect-ftp (to
an ftp: URL), /short.png (a body shorter than its Content-Length), /missing (404)."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.tiny_vision import png_bytes

PNG = png_bytes(40, 30, seed=7)
BIG = png_bytes(400, 400, seed=8)


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        routes = {"/ok.png": ("image/png", PNG), "/page": ("text/html", b"<html></html>"), "/big.png": ("image/png", BIG)}
        if self.path == "/slow.png":
            time.sleep(5)
            routes["/slow.png"] = ("image/png", PNG)
        if self.path == "/redirect-private":
            self.send_response(302)
            self.send_header("Location", "http://10.1.2.3/x.png")
            self.end_headers()
            return
        if self.path == "/redirect-ftp":
            self.send_response(302)
            self.send_header("Location", "ftp://127.0.0.1/x.png")
            self.end_headers()
            return
        if self.path == "/short.png":  # the connection closes with 100 bytes missing
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG) + 100))
            self.end_headers()
            self.wfile.write(PNG)
            return
        if self.path not in routes:
            self.send_response(404)
            self.end_headers()
            return
        kind, body = routes[self.path]
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass


@contextmanager
def image_server() -> Iterator[str]:
    """The server's base URL (http://127.0.0.1:<port>)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
