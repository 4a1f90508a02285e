"""Running the HTTP face (`app.py`) with uvicorn inside the server's own event loop, beside gRPC.

The server process owns the signals (SIGTERM drains both faces), so uvicorn's own signal handling
is switched off. The socket is bound here, so port 0 works and a busy port is an error at start.

uvicorn's HTTP/1.1 protocol is given what it lacks against slow and careless clients
(`_GuardedH11`): a connection must send its request line and headers within the header timeout
(else 408); a head over the header limit is 431 and malformed HTTP 400, each an OpenAI error
object; after such a refusal the connection is closed gracefully (what the client still sends is
read and dropped for a moment, so it reads the answer instead of a reset); a body the app did not
read (a 413 before it) is drained for at most the body timeout. Each refusal is counted and
logged like any request (`HttpApp.refused`).

h11 is lenient where RFC 9112 lets a server be strict, and a proxy in front of this server may
read the same bytes differently (request smuggling): `_StrictConnection` refuses, before h11 reads
it, a head with a bare LF or CR, an obs-folded header line, or both Content-Length and
Transfer-Encoding; h11 itself refuses conflicting Content-Lengths and any Transfer-Encoding but
`chunked`. Each is a 400 that closes the connection, so no byte after a refused head is read as
a request.

The listening socket has TCP_NODELAY, which Linux gives each accepted connection (asyncio sets it
only on sockets made with IPPROTO_TCP): without it, an answer written in two parts waits for the
client's delayed ACK, 40 ms and more on every request of a kept-alive connection after its first.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.errors import BadRequest, HeadersTooLarge, ServiceError, SlowClient, failure_for
from service.http.app import HttpApp
from service.http.errors import raw_response

LINGER_S = 2.0  # after a refusal: how long what the client still sends is read and dropped
_HEAD_END = re.compile(rb"\n\r?\n")  # where h11 ends a request's head (it takes bare LFs too)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the server process handles SIGTERM/SIGINT itself
        yield


def _framing_fault(head: bytes) -> str | None:
    """Why a request's whole head (request line, headers, blank line) breaks RFC 9112's framing
    rules that h11 does not keep, or None."""
    unpaired = head.replace(b"\r\n", b"")
    if b"\r" in unpaired or b"\n" in unpaired:
        return "a bare CR or LF in the request head (each line must end in CRLF)"
    lines = head.split(b"\r\n")[1:]
    if any(line[:1] in (b" ", b"\t") for line in lines):
        return "an obs-folded header line (one that begins with a space or tab)"
    names = {line.partition(b":")[0].lower() for line in lines}
    if b"content-length" in names and b"transfer-encoding" in names:
        return "both Content-Length and Transfer-Encoding headers"
    return None


class _StrictConnection(h11.Connection):
    """h11's server side that refuses a head `_framing_fault` finds, before h11 reads it (uvicorn
    answers the RemoteProtocolError with `send_400_response`); `fault` says why, once it did."""

    fault: str | None = None

    def next_event(self) -> Any:
        if self.their_state is h11.IDLE:
            buffered = self.trailing_data[0]  # a head under the header limit, and at most one read more
            end = _HEAD_END.search(buffered)
            fault = _framing_fault(buffered[:end.end()]) if end else None
            if fault is not None:
                self.fault = fault
                raise h11.RemoteProtocolError(fault)
        return super().next_event()


class _GuardedH11(H11Protocol):
    """H11Protocol with a header timeout, 431 and 400 as OpenAI errors, graceful closes after a
    refusal, and a bound on draining an unread body. `app` is set per server (a subclass)."""

    app_face: HttpApp

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _StrictConnection(h11.SERVER, self.config.h11_max_incomplete_event_size)

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._lingering = False
        self._seen: object = None  # the request cycle whose head was seen last
        self._head_timer: asyncio.TimerHandle | None = None
        self._await_head()

    def _await_head(self) -> None:
        self._head_started = time.perf_counter()
        self._head_timer = self.loop.call_later(self.app_face.config.header_timeout_s, self._head_timeout)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # read and dropped
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._await_head()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.cycle is not self._seen:  # a request's head arrived whole
            self._seen = self.cycle
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        timeout = self.app_face.config.header_timeout_s
        self._refuse(SlowClient(f"the request line and headers did not arrive within {timeout:g} s"))

    def send_400_response(self, msg: str) -> None:
        """What uvicorn answers when h11 cannot parse the request."""
        limit = self.app_face.config.max_header_bytes
        if self.conn.fault is not None:
            self._refuse(BadRequest(f"invalid HTTP request: {self.conn.fault}"))
        elif len(self.conn.trailing_data[0]) > limit:
            self._refuse(HeadersTooLarge(f"the request line and headers are over the {limit:,}-byte limit"))
        else:
            self._refuse(BadRequest("invalid HTTP request (not HTTP/1.1 as h11 reads it)"))

    def _refuse(self, error: ServiceError) -> None:
        failure = failure_for(error)
        status = failure.rule.http
        self.transport.write(raw_response(failure))
        self._lingering = True
        self._unset_keepalive_if_required()
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the answer, then EOF
        self.loop.call_later(LINGER_S, self.transport.close)
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
        self.app_face.refused(status, peer, time.perf_counter() - self._head_started)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # The app answered before reading the body (413): uvicorn drains it, for a bounded time.
            self.loop.call_later(self.app_face.config.body_timeout_s, self._drain_timeout, self.cycle)

    def _drain_timeout(self, cycle: object) -> None:
        if self.cycle is cycle and self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()


class HttpServer:
    def __init__(self, app: HttpApp, host: str, port: int, *, certfile: str | None = None,
                 keyfile: str | None = None) -> None:
        protocol = type("_Protocol", (_GuardedH11,), {"app_face": app})
        config = uvicorn.Config(app, host=host, port=port, lifespan="off", access_log=False, log_level="warning",
                                ssl_certfile=certfile, ssl_keyfile=keyfile, timeout_graceful_shutdown=5,
                                http=protocol, h11_max_incomplete_event_size=app.config.max_header_bytes)
        self._server = _Server(config)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
