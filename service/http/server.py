"""Running the HTTP face (`app.py`) with uvicorn inside the server's own event loop, beside gRPC.

The server process owns the signals (SIGTERM drains both faces), so uvicorn's own signal handling
is switched off. The socket is bound here, so port 0 works and a busy port is an error at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the server process handles SIGTERM/SIGINT itself
        yield


class HttpServer:
    def __init__(self, app: FastAPI, host: str, port: int, *, certfile: str | None = None,
                 keyfile: str | None = None) -> None:
        config = uvicorn.Config(app, host=host, port=port, lifespan="off", access_log=False, log_level="warning",
                                ssl_certfile=certfile, ssl_keyfile=keyfile, timeout_graceful_shutdown=5)
        self._server = _Server(config)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise OSError(f"cannot listen on {host}:{port} (HTTP): {exc.strerror or exc}") from None
        self.port: int = self._socket.getsockname()[1]
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._socket.listen(128)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Finish the requests in flight (uvicorn's graceful shutdown), then close."""
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._socket.close()
