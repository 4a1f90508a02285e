"""A real HTTP server on 127.0.0.1 that serves one image the ways remote hosts do, good and bad: for
the remote-image rules (what is fetched, how fast, from where), in-process and through a server.

    with ImageUpstream(png) as up:
        up.url("/image.png"); up.url("/drip/3"); up.url("/to", "file:///etc/passwd"); up.hits

Routes: `/image.png`; `/big.png` (the image 100 times); `/status/N` (an empty answer with status N);
`/drip/S` (the image in `DRIP_PIECES` pieces spread over S seconds: every read gets data soon, only
the whole transfer is slow); `/to?url` (302 to url); `/loop` (302 to itself); `/hop` (302 to
/image.png). Every request is counted (`hits`, by path) and its Host header kept (`hosts`).
"""

from __future__ import annotations

import collections
import http.server
import threading
import time
from urllib.parse import unquote, urlsplit

DRIP_PIECES = 50


class ImageUpstream:
    def __init__(self, image: bytes) -> None:
        self.image = image
        self.hits: collections.Counter[str] = collections.Counter()
        self.hosts: list[str] = []
        upstream = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                parts = urlsplit(self.path)
                upstream.hits[parts.path] += 1
                upstream.hosts.append(self.headers.get("host", ""))
                try:
                    self._route(parts.path, unquote(parts.query))
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeouts, sizes)
                    pass

            def _route(self, path: str, query: str) -> None:
                if path == "/image.png":
                    self._send(200, upstream.image)
                elif path == "/big.png":
                    self._send(200, upstream.image * 100)
                elif path.startswith("/status/"):
                    self._send(int(path.removeprefix("/status/")), b"")
                elif path.startswith("/drip/"):
                    seconds, image = float(path.removeprefix("/drip/")), upstream.image
                    self._head(200, len(image))
                    size = -(-len(image) // DRIP_PIECES)
                    for i in range(0, len(image), size):
                        self.wfile.write(image[i:i + size])
                        self.wfile.flush()
                        time.sleep(seconds * size / len(image))
                elif path in ("/to", "/loop", "/hop"):
                    self._redirect({"/to": query, "/loop": "/loop", "/hop": "/image.png"}[path])
                else:
                    self._send(404, b"")

            def _head(self, status: int, length: int) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(length))
                self.end_headers()

            def _send(self, status: int, body: bytes) -> None:
                self._head(status, len(body))
                self.wfile.write(body)

            def _redirect(self, where: str) -> None:
                self.send_response(302)
                self.send_header("Location", where)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:  # quiet
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def url(self, path: str, query: str = "", host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}" + (f"?{query}" if query else "")

    def __enter__(self) -> ImageUpstream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
