"""A TCP listener that records every connection and never reads one: the destination a test or
bench names to prove where the server did (or did not) connect, and a peer that never takes a push."""

from __future__ import annotations

import socket
import threading

# Loopback aliases (Linux routes 127.0.0.0/8 to lo): the caller, another host, a stranger.
CALLER, OTHER_HOST, STRANGER = "127.0.0.1", "127.0.0.2", "127.0.0.3"


class Recorder:
    """Listens on `host` (a free port); `peers` are the connections it accepted, each held open unread."""

    def __init__(self, host: str = CALLER) -> None:
        self._sock = socket.socket()
        self._sock.bind((host, 0))
        self._sock.listen(1024)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.peers: list[tuple[str, int]] = []
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            self.peers.append(peer)
            self._held.append(conn)

    def close(self) -> None:
        self._sock.close()
        for conn in self._held:
            conn.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
