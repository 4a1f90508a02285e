"""SGLang's encoder routes as an attacker who reaches them would use them, against a real
`kimi-vision serve` (small capacity: one work slot, two queue places) on 127.0.0.1, with callers on
loopback aliases (Linux routes all of 127.0.0.0/8 to lo; a client binds its source address to be
another host) and listeners that record every connection made to them and never read one (a black
hole: TCP accepted, no ZMQ handshake ever answered):

- no connection is made to a destination the rule does not allow (another address than the
  caller's, the server's own ports, a port list over the bound), not even the error report;
- a flood of registrations stays under MAX_PARTS (then 503), a flood of bad-image `/encode`s to a
  black hole under the error sockets' budget (open files of the serve process), and the serve
  process's RSS comes back;
- chat completions answer 200 while more `/encode`s than the whole capacity push to a black hole,
  and a client that leaves is logged 499;
- nothing anywhere is a 500.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from black_hole import CALLER, OTHER_HOST, STRANGER, Recorder
from images import png
from serve_process import ServeProcess, serve_command

from service.epd.destinations import DestinationRule
from service.epd.sglang_zmq import MAX_ERROR_PUSHES, MAX_PARTS, MAX_PORTS

pytestmark = pytest.mark.timeout(600)
PNG = png(64, 48, seed=3)


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _request(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: encoder\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def _answer(raw: bytes) -> tuple[int, dict | None]:
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest) if rest else None


def post(port: int, path: str, body: dict | bytes, *, source: str = CALLER,
         timeout_s: float = 120) -> tuple[int, dict | None]:
    """One request on a fresh connection from `source` (an address of this machine)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with socket.create_connection((CALLER, port), timeout=timeout_s, source_address=(source, 0)) as sock:
        sock.sendall(_request(path, data))
        return _answer(b"".join(iter(lambda: sock.recv(65536), b"")))


def _encode(req_id: str, items: list[str], **where) -> dict:
    return {"req_id": req_id, "mm_items": items, "num_parts": 1, "part_idx": 0, "modality": "IMAGE",
            "prefill_host": CALLER, **where}


def _register(req_id: str, url: str, count: int = 1) -> dict:
    return {"req_id": req_id, "receive_count": count, "receive_url": url, "modality": "IMAGE"}


def _open_files(proc: ServeProcess) -> int:
    return len(os.listdir(f"/proc/{proc.proc.pid}/fd"))


def _rss(proc: ServeProcess) -> int:
    for line in Path(f"/proc/{proc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServeProcess.start(["--devices", "cpu:1", "--http-port", "0", "--max-concurrency", "1", "--max-queue", "2",
                             "--drain-seconds", "1"],
                            log_path=tmp_path_factory.mktemp("epd-security") / "serve.log") as proc:
        yield SimpleNamespace(proc=proc, port=proc.http_port)


def test_no_connection_is_made_to_a_destination_not_allowed(server):
    """Default rule (peer): the caller's own address only, never the server's own ports; each
    refusal is a 400 naming the rule, before the image is looked at (a bad image: no error push)."""
    proc, port = server.proc, server.port
    with Recorder(STRANGER) as stranger, Recorder(CALLER) as callers:
        own = [proc.port, port]
        cases = [
            (_encode("d-1", [_url(b"junk")], prefill_host=STRANGER, embedding_port=stranger.port), CALLER,
             "not allowed by --epd-allowed-destinations peer; the caller is 127.0.0.1"),
            (_encode("d-2", [_url(PNG)], prefill_host=STRANGER, embedding_port=[stranger.port]), CALLER,
             "not allowed"),
            (_encode("d-3", [_url(b"junk")], prefill_host=CALLER, embedding_port=callers.port), OTHER_HOST,
             "the caller is 127.0.0.2"),
            (_encode("d-4", [_url(b"junk")], prefill_host="localhost", embedding_port=callers.port), OTHER_HOST,
             "localhost (127.0.0.1)"),
            *((_encode(f"d-own-{p}", [_url(b"junk")], embedding_port=p), CALLER, "this server's own listening")
              for p in own),
            (_encode("d-5", [_url(PNG)], embedding_port=list(range(20000, 20000 + MAX_PORTS + 1))), CALLER,
             f"at most {MAX_PORTS}"),
        ]
        for body, source, words in cases:
            status, answer = post(port, "/encode", body, source=source)
            assert status == 400 and words in answer["message"], (body["req_id"], status, answer)
        for url, source in ((f"{STRANGER}:{stranger.port}", CALLER), (f"{CALLER}:{callers.port}", OTHER_HOST),
                            (f"{CALLER}:{proc.port}", CALLER)):
            status, answer = post(port, "/scheduler_receive_url", _register("d-6", url), source=source)
            assert status == 400 and "destination" in answer["message"], (url, answer)
        time.sleep(1.0)  # what would have connected has by now (the error report pushes at once)
        assert stranger.peers == [] and callers.peers == []

        # The recorder sees what is allowed: the caller's own address, its error report.
        status, _ = post(port, "/encode", _encode("d-7", [_url(b"junk")], embedding_port=callers.port))
        deadline = time.monotonic() + 10
        while not callers.peers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 400 and callers.peers and stranger.peers == []


@pytest.mark.parametrize(("path", "change", "words"), [
    ("/encode", {"req_id": "r" * 257}, "req_id is over 256 bytes"),
    ("/encode", {"req_id": "r" * (8 << 20)}, "req_id is over 256 bytes"),
    ("/encode", {"num_parts": 10**30}, "num_parts must be a positive integer up to 1024"),
    ("/encode", {"embedding_port": list(range(1, 5001))}, "at most 64"),
    ("/scheduler_receive_url", {"receive_count": 10**30}, "receive_count must be a positive integer up to 256"),
    ("/scheduler_receive_url", {"req_id": "q" * (1 << 20)}, "req_id is over 256 bytes"),
    ("/scheduler_receive_url", {"receive_url": "127.0.0.1:99999"}, "receive_url must be host:port"),
    ("/scheduler_receive_url", {"receive_url": "[::1"}, "receive_url must be host:port"),
])
def test_oversized_fields_are_refused(server, path, change, words):
    base = _encode("s-1", [_url(PNG)], embedding_port=20001) if path == "/encode" else _register("s-1", "127.0.0.1:1")
    status, answer = post(server.port, path, {**base, **change})
    assert status == 400 and words in answer["message"], answer
    assert len(json.dumps(answer)) < 2000  # the refused req_id is not echoed back


def test_a_registration_flood_stays_under_its_bound(server):
    """MAX_PARTS registrations fill the table; beyond it 503 (retryable), never a 500; nothing is
    pushed (no /encode came); the serve process's RSS is back within 5 % once the flood is over."""
    proc, port = server.proc, server.port
    with Recorder(CALLER) as rank:
        before = _rss(proc)
        url = f"{CALLER}:{rank.port}"
        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(lambda i: post(port, "/scheduler_receive_url", _register(f"f-{i}", url))[0],
                                     range(MAX_PARTS)))
            beyond = list(pool.map(lambda i: post(port, "/scheduler_receive_url", _register(f"g-{i}", url)),
                                   range(20)))
        assert statuses.count(200) >= MAX_PARTS - 10 and set(statuses) <= {200}, sorted(set(statuses))
        assert {status for status, _ in beyond} == {503}
        assert "retry" in beyond[0][1]["message"]
        # A registered part is still answered (it is in the table), and a stranger cannot take it.
        assert post(port, "/scheduler_receive_url", _register("f-1", url))[0] == 200
        status, answer = post(port, "/scheduler_receive_url", _register("f-1", f"{OTHER_HOST}:{rank.port}"),
                              source=OTHER_HOST)
        assert status == 400 and "registered from another host" in answer["message"]
        time.sleep(2.0)
        after = _rss(proc)
        assert rank.peers == []
    assert after <= before * 1.05, f"RSS {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB"


def test_bad_encodes_to_a_black_hole_hold_a_bounded_number_of_sockets(server):
    """Each failed /encode reports its error to the language side; to a peer that never reads, each
    report holds a socket until ERROR_SEND_TIMEOUT_S, within MAX_ERROR_PUSHES: the open files of the
    serve process stay under that bound, the reports beyond it are dropped (and logged), and every
    answer is a 400 or a 429."""
    proc, port = server.proc, server.port
    with Recorder(CALLER) as hole:
        base = _open_files(proc)
        peak = [base]
        flooding = threading.Event()

        def sample() -> None:
            while not flooding.is_set():
                peak.append(_open_files(proc))
                time.sleep(0.02)

        watcher = threading.Thread(target=sample)
        watcher.start()
        try:
            bodies = [_encode(f"b-{i}", [_url(b"not an image")], embedding_port=hole.port) for i in range(400)]
            with ThreadPoolExecutor(4) as pool:
                statuses = [status for status, _ in pool.map(lambda b: post(port, "/encode", b), bodies)]
        finally:
            flooding.set()
            watcher.join()
        assert set(statuses) <= {400, 429}, sorted(set(statuses))
        assert statuses.count(400) > MAX_ERROR_PUSHES  # enough failed to spend the budget
        # Each ZMQ socket is a TCP connection and its mailbox; the HTTP connections come and go.
        assert max(peak) - base <= 2 * MAX_ERROR_PUSHES + 40, (base, max(peak))
        assert len(hole.peers) <= MAX_ERROR_PUSHES
        assert "error reports to the language side dropped" in proc.log_text()
        status, answer = post(port, "/encode", _encode("b-ok", [_url(PNG)], embedding_port=[]))
        assert status == 400 and "embedding_port" in answer["message"]  # still answering


def test_chat_answers_while_encodes_push_to_a_black_hole(server):
    """More /encodes than the whole capacity (1 slot + 2 queue places) pushing to a peer that
    never reads: each gives its place back once its rows are made, so a chat completion still
    answers 200; their clients leave and the access log says 499."""
    proc, port = server.proc, server.port
    capacity = 3
    with Recorder(CALLER) as hole:
        clients = []
        for i in range(capacity + 3):
            sock = socket.create_connection((CALLER, port), timeout=120)
            body = json.dumps(_encode(f"h-{i}", [_url(PNG)], embedding_port=hole.port)).encode()
            sock.sendall(_request("/encode", body))
            clients.append(sock)
            deadline = time.monotonic() + 60
            while len(hole.peers) <= i and time.monotonic() < deadline:
                time.sleep(0.05)  # its push has begun: its rows are made
            assert len(hole.peers) > i, f"push {i} never connected: {proc.log_text()[-2000:]}"
        chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(PNG)}},
                                                          {"type": "text", "text": "What is it?"}]}], "max_tokens": 1}
        status, answer = post(port, "/v1/chat/completions", chat)
        assert status == 200, answer
        logged = proc.log_text().count("POST /encode peer=")
        for sock in clients:
            sock.close()
        deadline = time.monotonic() + 10
        while proc.log_text().count("POST /encode peer=") < logged + capacity + 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        lines = [line for line in proc.log_text().splitlines() if "POST /encode peer=" in line][logged:]
        assert len(lines) == capacity + 3 and all("status=499" in line for line in lines), lines
        # The only 5xx of the whole module: the registrations beyond the table's bound (503, retryable).
        assert [line for line in proc.log_text().splitlines() if "status=5" in line
                and not ("POST /scheduler_receive_url" in line and "status=503" in line)] == []
        assert post(port, "/v1/chat/completions", chat)[0] == 200


def test_the_rule_parses_what_the_help_says():
    ip = ipaddress.ip_address
    rule = DestinationRule.parse(["peer", "10.0.0.0/8:30000-30100,[fd00::/8]:5000", "127.0.0.2"])
    assert str(rule) == "peer,10.0.0.0/8:30000-30100,[fd00::/8]:5000,127.0.0.2"
    assert rule.allows(ip("10.1.2.3"), 30050, None) and not rule.allows(ip("10.1.2.3"), 30101, None)
    assert rule.allows(ip("fd00::1"), 5000, None) and not rule.allows(ip("fd00::1"), 5001, None)
    assert rule.allows(ip("192.0.2.7"), 1, ip("192.0.2.7")) and not rule.allows(ip("192.0.2.7"), 1, ip("192.0.2.8"))
    for bad in ("", "10.0.0.0/8:0", "10.0.0.0/8:9-3", "[::1", "peer:x", "no-such-host.invalid"):
        with pytest.raises(ValueError, match="--epd-allowed-destinations"):
            DestinationRule.parse([bad])
    help_text = subprocess.run([*serve_command(), "serve", "--help"], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "COLUMNS": "200"}, check=True).stdout
    assert "--epd-allowed-destinations" in help_text and "Default: peer" in help_text and "--epd-port" in help_text
    refused = subprocess.run([*serve_command(), "serve", "--epd-allowed-destinations", "10.0.0.0/8:0"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--epd-allowed-destinations" in refused.stderr, refused.stderr
