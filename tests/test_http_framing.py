"""The HTTP face's framing, connections and log lines through real `kimi-vision serve` processes
on 127.0.0.1 and raw sockets:

- a head a proxy in front could frame differently than this server (both Content-Length and
  Transfer-Encoding, an obs-folded line, a bare LF or CR, conflicting lengths, a coding other
  than `chunked`) is a 400 that closes the connection: what was sent after it is never answered
  nor handled, also behind an answered request on the same connection;
- a caller's CR, LF and other control characters in a path stay on one line of the text log, and
  intact in valid JSON in the JSON log;
- kept-alive requests are as fast as a fresh connection's, in plain HTTP and over TLS.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import ssl
import statistics
import time
from pathlib import Path

import pytest
from certificates import self_signed
from openai_schema import ErrorResponse
from serve_process import ServeProcess

from service.auth import ENV_VAR
from service.http.server import LINGER_S

pytestmark = pytest.mark.timeout(300)

TOKEN = secrets.token_urlsafe(24)
AUTH = f"authorization: Bearer {TOKEN}\r\n".encode()
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")  # the text format's first column


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"), "server")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """Plain HTTP, the text log, a token."""
    log = tmp_path_factory.mktemp("framing") / "serve.log"
    with ServeProcess.start(["--devices", "cpu:1", "--http-port", "0"], log_path=log, env={ENV_VAR: TOKEN}) as proc:
        yield proc


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, tls_files: tuple[Path, Path]):
    """HTTP over TLS, the JSON log, a token."""
    cert, key = tls_files
    log = tmp_path_factory.mktemp("framing-tls") / "serve.log"
    args = ["--devices", "cpu:1", "--http-port", "0", "--log-format", "json", "--tls-cert", str(cert),
            "--tls-key", str(key)]
    with ServeProcess.start(args, log_path=log, env={ENV_VAR: TOKEN}) as proc:
        yield proc


def _read_answer(sock: socket.socket, buffered: bytes = b"") -> tuple[int, bytes, bytes]:
    """One HTTP answer (a Content-Length body) from `sock`: (status, body, what came after it)."""
    data = buffered
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 16)
        assert chunk, f"closed before a whole answer: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))
    while len(rest) < length:
        chunk = sock.recv(1 << 16)
        assert chunk, f"closed inside a body: {data!r}"
        rest += chunk
    return int(head.split()[1]), rest[:length], rest[length:]


def _until_closed(sock: socket.socket, after: bytes) -> tuple[bytes, float]:
    """What the server still sends, and the seconds until it closes (EOF)."""
    start = time.monotonic()
    while chunk := sock.recv(1 << 16):
        after += chunk
    return after, time.monotonic() - start


def _logged(server: ServeProcess, words: str, timeout_s: float = 10.0) -> str:
    """The server's log once a line holding `words` is in it (the log is written off the event loop)."""
    deadline = time.monotonic() + timeout_s
    while words not in (log := server.log_text()):
        assert time.monotonic() < deadline, f"no log line with {words!r}"
        time.sleep(0.05)
    return log


def _get(path: str, request_id: str, *, auth: bool = True) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nhost: x\r\nx-request-id: {request_id}\r\n".encode() + (AUTH if auth else b"")
            + b"\r\n")


CHUNKED_BODY = b"2\r\n{}\r\n0\r\n\r\n"
BAD_HEADS = {  # (the head, a body that frames it as chunked would), and what the 400 says
    "content-length and transfer-encoding": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 42\r\n"
                                             b"transfer-encoding: chunked\r\n", "both Content-Length and Transfer"),
    "transfer-encoding and content-length": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nTransfer-Encoding: "
                                             b"chunked\r\nContent-Length: 3\r\n", "both Content-Length and Transfer"),
    "obs-fold": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-note: a\r\n transfer-encoding: chunked\r\n",
                 "obs-folded header line"),
    "obs-fold with a tab": (b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-note: a\r\n\tb\r\n", "obs-folded header line"),
    "bare LF everywhere": (b"GET /v1/models HTTP/1.1\nhost: x\n", "bare CR or LF"),
    "one bare LF": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\ntransfer-encoding: chunked\r\n", "bare CR or LF"),
    "a bare CR": (b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-note: a\rb\r\n", "bare CR or LF"),
    "conflicting content-lengths": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n"
                                    b"content-length: 42\r\n", "invalid HTTP request"),
    "a coding other than chunked": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                                    b"transfer-encoding: gzip, chunked\r\n", "invalid HTTP request"),
    "transfer-encoding twice": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
                                b"transfer-encoding: chunked\r\n", "invalid HTTP request"),
}


@pytest.mark.parametrize("ahead", [False, True], ids=["first", "behind an answered request"])
@pytest.mark.parametrize("name", BAD_HEADS)
def test_an_ambiguous_head_is_a_400_that_closes_the_connection(server: ServeProcess, name: str, ahead: bool) -> None:
    head, words = BAD_HEADS[name]
    newline = b"\n" if b"\r" not in head else b"\r\n"
    first, smuggled = f"first-{secrets.token_hex(4)}", f"smuggled-{secrets.token_hex(4)}"
    data = head + newline + CHUNKED_BODY + _get("/v1/models", smuggled)
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.settimeout(10)
        sock.sendall((_get("/v1/models", first) if ahead else b"") + data)  # one write: pipelined
        rest = b""
        if ahead:
            status, _, rest = _read_answer(sock)
            assert status == 200
        status, body, rest = _read_answer(sock, rest)
        after, seconds = _until_closed(sock, rest)
    error = ErrorResponse.model_validate_json(body).error
    assert status == error.code == 400 and words in error.message, body
    assert after == b"" and seconds < LINGER_S / 2  # closed at once: nothing more was answered
    marker = f"after-{secrets.token_hex(4)}"
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:  # a later request is logged after it
        sock.settimeout(10)
        sock.sendall(_get("/v1/models", marker))
        assert _read_answer(sock)[0] == 200
    log = _logged(server, marker)
    assert (first in log) is ahead
    assert smuggled not in log  # never handled


def test_chunked_and_sized_bodies_are_still_served_on_one_connection(server: ServeProcess) -> None:
    """The same connection, kept alive: a chunked body, a sized one, then a GET (the chat's answer
    is 400 only because `{}` holds no messages: the body was read and parsed)."""
    chunked = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + AUTH + b"transfer-encoding: chunked\r\n\r\n"
    sized = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + AUTH + b"content-length: 2\r\n\r\n{}"
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.settimeout(30)
        for request in (chunked + CHUNKED_BODY, sized):
            sock.sendall(request)
            status, body, rest = _read_answer(sock)
            assert status == 400 and "messages" in ErrorResponse.model_validate_json(body).error.message, body
            assert rest == b""
        sock.sendall(_get("/v1/models", "then-a-get"))
        assert _read_answer(sock)[0] == 200


# A path that would write a fake record if logged as it is: CR LF, then what a record looks like.
FORGED = "2026-01-01 00:00:00,000 INFO kimi_vision.server: forged"
EVIL_PATH = "/v1/models%0d%0a" + FORGED.replace(" ", "%20") + "%e2%80%a8%1b[31m%0a"
EVIL_DECODED = "/v1/models\r\n" + FORGED + "\u2028\x1b[31m\n"


def test_a_path_with_line_breaks_stays_on_one_line_of_the_text_log(server: ServeProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.settimeout(10)
        sock.sendall(_get(EVIL_PATH, "evil-path", auth=False))  # refused (no token), with a warning naming the path
        assert _read_answer(sock)[0] == 401
    log = _logged(server, "id=evil-path")
    lines = [line for line in log.splitlines() if "forged" in line]
    escaped = r"/v1/models\r\n" + FORGED + r"\u2028\x1b[31m\n"
    assert any("WARNING" in line and f"refused GET {escaped}: " in line for line in lines), lines
    assert lines and all(TIMESTAMP.match(line) and not line.startswith(FORGED) for line in lines), lines


def test_a_path_with_line_breaks_is_intact_in_valid_json(tls_server: ServeProcess,
                                                         tls_files: tuple[Path, Path]) -> None:
    context = ssl.create_default_context(cafile=str(tls_files[0]))
    with (socket.create_connection(("127.0.0.1", tls_server.http_port)) as raw,
          context.wrap_socket(raw, server_hostname="127.0.0.1") as sock):
        sock.settimeout(10)
        sock.sendall(_get(EVIL_PATH, "evil-path", auth=False))
        assert _read_answer(sock)[0] == 401
    _logged(tls_server, '"request_id": "evil-path", "method"')
    records = [json.loads(line) for line in tls_server.log_text().splitlines()]  # every line one JSON object
    (warning,) = [r for r in records if r["message"].startswith("refused GET")]
    assert warning["message"].startswith(f"refused GET {EVIL_DECODED}: ") and warning["request_id"] == "evil-path"


def _round_trip(sock: socket.socket, request: bytes) -> float:
    start = time.perf_counter()
    sock.sendall(request)
    assert _read_answer(sock)[0] == 200
    return time.perf_counter() - start


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_kept_alive_requests_are_as_fast_as_a_fresh_connections(server: ServeProcess, tls_server: ServeProcess,
                                                                tls_files: tuple[Path, Path], tls: bool) -> None:
    """Median of 20 each: `GET /v1/models` on a connection kept alive, and on a fresh one (its connect
    and handshake included). Without TCP_NODELAY an answer written in two parts waits for the
    client's delayed ACK: 40 ms and more on each kept-alive request after the first."""
    port = (tls_server if tls else server).http_port
    context = ssl.create_default_context(cafile=str(tls_files[0]))
    request = _get("/v1/models", "timed")

    def connect() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.settimeout(10)
        return context.wrap_socket(sock, server_hostname="127.0.0.1") if tls else sock

    fresh = []
    for _ in range(20):
        start = time.perf_counter()
        with connect() as sock:
            _round_trip(sock, request)
        fresh.append(time.perf_counter() - start)
    with connect() as sock:
        _round_trip(sock, request)  # the first request of a connection is the fresh case
        kept = [_round_trip(sock, request) for _ in range(20)]
    fresh_ms, kept_ms = statistics.median(fresh) * 1e3, statistics.median(kept) * 1e3
    assert kept_ms <= fresh_ms + 2.0, f"kept alive {kept_ms:.1f} ms, fresh {fresh_ms:.1f} ms"
