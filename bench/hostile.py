"""Normal traffic beside an abusive mix, against a real `kimi-vision serve` on 127.0.0.1 (every face it has).

    .venv/bin/python -m bench.hostile --seconds 60 [--json OUT.json]

Starts the server (gRPC on its port, the HTTP face with SGLang's encoder routes on it, the health
port, /metrics; a bearer token, which every normal client sends; `--max-model-len 4096`; remote
images allowed from the bench's own image upstream on 127.0.0.1; 2-s HTTP timeouts; the default
`--epd-allowed-destinations peer`), a second small server in vLLM's EC producer role (for the
encoder-cache entries only it writes), the upstream, and TCP listeners that record every
connection and never read one (black holes), on loopback aliases (Linux routes 127.0.0.0/8 to lo;
a client binds 127.0.0.2 to be another host). Then it runs:

0. SGLang's registration table filled (`/scheduler_receive_url`, each a new part, until the first
   503 at MAX_PARTS; not measured), so that every phase runs beside a full table;
1. a warm-up (`--warmup-seconds`): normal traffic and every abusive kind, so that every metric
   label the run can make exists and the allocators reach their working size (not measured);
2. the baseline: `--clients` normal clients for `--seconds`;
3. the abusive run: the same normal clients for `--seconds`, beside the abusive mix;
4. at rest, after the settled RSS is read: 20 `GET /v1/models` on one kept-alive connection and 20
   on fresh ones.

A normal request is a chat completion with a 64x48 PNG as a data: URL, `max_tokens` 8, not
streamed, sent back to back by each client. The abusive mix, each kind its own coroutine on its own
connections, each with the statuses it must get (`EXPECTED`; a gRPC kind's are status names):

- the HTTP face: slow heads (8 at a time, the request line and half a header, then nothing: 408),
  slow bodies (2 at a time, 10 bytes of 1,000: 408), large bodies (once a second: 32 MiB that is not
  JSON, read whole: 400; 100 MiB declared, over the message limit, of which 1 MiB is sent: 413),
  over-long prompts (20 KB of text, ~14k tokens: 400, 10/s), slow remote images (4 images, each
  dripped over 2 s by the upstream, fetched at once: 200), made-up methods (20/s against /health: 405);
- issue 31, SGLang's routes (no token: the language side sends none): destinations not allowed
  (a stranger's address 127.0.0.3 with a listening port, from a good and a bad image; the caller's
  address named from 127.0.0.2; 169.254.169.254:80; each of the server's own four ports; the same
  for `/scheduler_receive_url`: 400 within 1 s, a round every 3 s); fields over their bounds
  (65 and 5,000 ports, a 257-B and a 1-MB `req_id`, `num_parts` 10^30, an 8-MiB `req_id` and
  `receive_count` 10^30 registered: 400, the `req_id` never echoed, a round every 3 s);
  the registration flood going on beside the full table (5/s: 503); bad images whose error
  reports go to a black hole (4.3/s, twice the error sockets' budget within the 30 s each may
  hold one: 400, or 429 when the queue is full); good images pushed to a black hole whose clients
  leave once the push has connected (one every 4 s, each to a black hole of its own: 499 in the
  access log);
- issue 31, uuids and framing: chat image parts with an invalid uuid (`../x`, `a/b`, NUL, 10 KB,
  `okname\\n`, empty, 7: 400, a round every 3 s); in the producer, another image under a uuid
  already written and uuids shaped like another image's content hash (400, a round every 3 s);
  heads a proxy could frame otherwise
  (both Content-Length and Transfer-Encoding in both orders, obs-fold, bare LF, bare CR, two
  differing Content-Lengths, `Transfer-Encoding: gzip, chunked`), each followed by a smuggled
  `GET /v1/models` on the same connection (one 400, then closed within 1 s; a round every 3 s);
  a path with CR LF and a forged log line in it, without the token (401, 1/s);
- issue 31, the side doors: health Watch floods on the health port (at the start of the phase 66
  connections of 17 streams opened over 10 s, over both bounds, held 2 s while Check is asked on
  both ports; then
  every 5 s one connection of 20: SERVING up to the bounds, RESOURCE_EXHAUSTED beyond, Check
  SERVING); bytes that are not protobuf to every method of every service on both ports
  (INVALID_ARGUMENT, a round every 3 s); 200 idle connections to /metrics at a time (over its 128),
  a scrape beside them (200), each closed by the server within its idle timeout + 1 s.
- issue 32, the routes vLLM serves: `/v1/completions`, `/tokenize`, `/detokenize`, `/version` and
  `/metrics` on the HTTP port, each refused case with the status it must get (bad prompts, token
  ids out of range, 1,025 prompts: 413, `suffix`, an image or `<|media_pad|>` in a prompt, unknown
  `stream_options` keys, `echo` with `logprobs`, an unknown model: 404, a wrong method: 405, no
  token: 401), and a few that must answer 200 (a 2-token completion, a prompt tokenized and
  detokenized, `/version`, a scrape), a round every 3 s.

Checks (exit 1 if one fails): the normal requests' p99 in the abusive run within 2x the
baseline's; no 5xx answer at all (normal or abusive, either phase; the producer's too); every
abusive request got its expected status, and the Watch floods got past the bounds; the server's
RSS, settled (read after 2 s without traffic, then again once the server has handed its free heap
back, which 64 Watch streams that end set off; the check is on the second, both are reported),
drifts less than 5 % over the abusive run; the
abusive run adds no /metrics series (names and labels; the byte size is reported: counters grow a
digit now and then); its open files stay within what the bounds allow (error-report and push
sockets, the connections the bench holds) and its threads within 8 of their count at its start;
no connection ever reached a listener only a refused request named; no smuggled request was
handled; no line of the text log starts with the forged text; the error reports beyond their
budget were dropped (the server's warning, in the abusive run); the registrations answered 200 are
at most MAX_PARTS (while none can have expired: a run shorter than 180 s from the fill) and some
were refused; the producer's entries are kept bit for bit, none added; the kept-alive median is
within 2 ms of the fresh connections'. The report also gives the CPU seconds of the server (with
its encoder workers), the producer and the bench itself in each phase: they share the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import random
import re
import secrets
import socket
import statistics
import string
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import psutil
from grpc_health.v1 import health_pb2
from PIL import Image

from service.auth import ENV_VAR
from service.epd.sglang_zmq import (
    ERROR_SEND_TIMEOUT_S,
    MAX_ERROR_PUSHES,
    MAX_PARTS,
    MAX_PORTS,
    REGISTRATION_TIMEOUT_S,
)
from service.metrics import IDLE_TIMEOUT_S, MAX_CONNECTIONS
from service.rpc._proto import vision_pb2 as pb
from service.rpc.health import MAX_WATCHES, MAX_WATCHES_PER_CONNECTION, RELEASE_AFTER_WATCHES, RELEASE_DELAY_S
from tests.black_hole import CALLER, OTHER_HOST, STRANGER, Recorder
from tests.image_upstream import ImageUpstream
from tests.serve_process import ServeProcess

MODEL_LEN = 4096
TIMEOUT_S = 2.0  # the server's header and body timeouts
P99_RATIO_LIMIT = 2.0
RSS_DRIFT_LIMIT = 0.05
KEPT_ALIVE_LIMIT_MS = 2.0  # a kept-alive request's median over a fresh connection's
THREAD_SLACK = 8  # threads the abusive run may add (a thread per idle /metrics connection would be 128+)
FD_SLACK = 40  # open files beyond what the bounds and the bench's own connections account for
AT_ONCE_S = 1.0  # a refused destination is answered within this (no connection is tried)
# The probes (a destination, a field, a uuid, a head, a forged path, a protobuf: what each answer is
# proves the point, not how many) run a round of their cases every PROBE_ROUND_S; the floods are sized
# from the bounds they must reach. (With a round a second and the floods twice as fast, the whole mix
# took the normal p99 to 2.37x on a shared 2-core machine: see docs/BENCHMARKS.md.)
PROBE_ROUND_S = 3.0
CLOSED_WITHIN_S = 1.0  # after a framing 400 the server closes at once (LINGER_S, 2 s, is for a body still coming)
TOKEN = secrets.token_urlsafe(24)
AUTH = {"authorization": f"Bearer {TOKEN}"}
DROPPED_REPORTS = "error reports to the language side dropped"  # the server's warning once MAX_ERROR_PUSHES are in use

# What each abusive kind must get; anything else fails the run. HTTP kinds: statuses; gRPC kinds:
# status names; a few outcomes the bench names itself ("slow", "echoed", "open", "unlogged").
EXPECTED: dict[str, set[int | str]] = {
    "slow_head": {408}, "slow_body": {408}, "large_body": {400, 413}, "over_long": {400},
    "slow_images": {200}, "made_up_method": {405},
    "epd_destination": {400}, "epd_oversized": {400}, "epd_registration": {200, 503},
    "epd_error_report": {400, 429}, "epd_black_hole_push": {499},
    "uuid": {400}, "ec_entry": {400}, "framing": {400}, "log_forging": {401},
    "health_watch": {"SERVING", "RESOURCE_EXHAUSTED"}, "health_check": {"SERVING"},
    "not_protobuf": {"INVALID_ARGUMENT"}, "metrics_idle": {"closed"}, "metrics_scrape": {200},
    "vllm_routes_refused": {400, 401, 404, 405, 413}, "vllm_routes_ok": {200},
}
# Outcomes a kind must have seen, not only been allowed: a Watch flood that never met a bound proves nothing.
REQUIRED: dict[str, set[int | str]] = {"health_watch": {"SERVING", "RESOURCE_EXHAUSTED"}}


def _png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


PNG = _png(64, 48)
OTHER_PNG = _png(64, 48, seed=1)  # the producer's second image
NORMAL = {"messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": _data_url(PNG)}},
    {"type": "text", "text": "What is in the picture?"}]}], "max_tokens": 8}
OVER_LONG = {"messages": [{"role": "user", "content": "Lorem ipsum dolor sit amet. " * 730}], "max_tokens": 8}
NOT_JSON = b"x" * (32 << 20)  # under the 64 MiB message limit: read whole, then refused
NOT_AN_IMAGE = _data_url(b"not an image")
BAD_UUIDS: list[object] = ["../x", "a/b", "a\x00b", "x" * 10_240, "okname\n", "", 7]
# A path that would write a whole fake record if the text log wrote it as it came.
FORGED = "2026-01-01 00:00:00,000 INFO x: forged"
FORGING_PATH = "/v1/models%0d%0a" + FORGED.replace(" ", "%20")
NOT_PROTOBUF = b"\xff\xff\xff\xff\x0f\x08"  # a field tag longer than a varint may be
WATCH, CHECK = "/grpc.health.v1.Health/Watch", "/grpc.health.v1.Health/Check"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
VISION = [f"/{pb.DESCRIPTOR.services_by_name['VisionService'].full_name}/{method.name}"
          for method in pb.DESCRIPTOR.services_by_name["VisionService"].methods]
WATCH_FLOOD = (MAX_WATCHES // MAX_WATCHES_PER_CONNECTION + 2, MAX_WATCHES_PER_CONNECTION + 1)  # connections, each
# The big flood opens its 1,122 streams over this long. All at once (every connection concurrently)
# they made the normal chats of the abusive run's first seconds ~3x as slow in the server's own
# times (p95 284 ms in the first 5 s, against a baseline p99 of 108 ms; see docs/BENCHMARKS.md):
# opening a gRPC stream costs Python code in the process of the HTTP face, at any rate (the bounds
# are on how many are open, not how fast). Spread out, it is a steady flood rather than one spike.
WATCH_RAMP_S = 10.0
IDLE_METRICS_CONNECTIONS = 200  # over MAX_CONNECTIONS
# HTTP connections the bench holds at most at once in the abusive run (each kind's), for the fd bound.
BENCH_HTTP_CONNECTIONS = 40


@dataclass
class Phase:
    latencies: list[float] = field(default_factory=list)  # normal requests answered 200, seconds
    normal: Counter = field(default_factory=Counter)  # normal requests by status
    abusive: dict[str, Counter] = field(default_factory=lambda: {kind: Counter() for kind in EXPECTED})
    seconds: float = 0.0  # how long the normal clients ran
    fds: list[int] = field(default_factory=list)  # the server's open files, sampled
    threads: list[int] = field(default_factory=list)  # the server's threads, sampled
    pushes_started: int = 0  # good /encodes whose push connected to its black hole
    left: list[str] = field(default_factory=list)  # request ids of /encode clients that left during the push
    watch_floods: list[dict] = field(default_factory=list)  # the big Watch floods' outcomes
    log_from: int = 0  # where the server's log stood when the phase began (characters)
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds over the phase: the server's, the bench's


@dataclass
class Run:
    """What every kind's coroutine needs: the servers, the listeners, this phase."""

    server: ServeProcess
    producer: ServeProcess
    upstream: ImageUpstream
    stranger: Recorder  # on 127.0.0.3: only refused requests name it
    silent: Recorder  # on 127.0.0.1: named by refused requests (from 127.0.0.2) and by registrations without /encode
    error_hole: Recorder  # where the bad images' error reports go
    push_holes: list[Recorder]  # one per good /encode pushed to a black hole
    entry: dict[str, Any]  # the producer's first entry: its uuid, file, bytes, the image's own key
    phase: Phase = field(default_factory=Phase)
    stop_at: float = 0.0
    serial: int = 0
    filled: Counter = field(default_factory=Counter)  # the registrations that filled the table, by status
    rss_parts: dict[str, dict[str, float]] = field(default_factory=dict)  # at the settled RSS readings

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"

    @property
    def port(self) -> int:
        return self.server.http_port

    def count(self, kind: str, outcome: int | str) -> None:
        self.phase.abusive[kind][outcome] += 1

    def next_id(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}-{self.serial}"

    def running(self, cycle_s: float = 0.0) -> bool:
        """Whether another round (of `cycle_s`) fits before the phase ends."""
        return time.monotonic() + cycle_s < self.stop_at


# ---------------------------------------------------------------------------------------------
# Raw HTTP


def _statuses(reply: bytes) -> list[int]:
    """The status of every answer in `reply` (bodies are JSON: no "HTTP/1.1 " line can be in one)."""
    return [int(code) for code in re.findall(rb"(?:^|\r\n)HTTP/1\.1 (\d{3}) ", reply)]


async def _exchange(port: int, data: bytes, *, source: str = CALLER, wait_s: float = 60.0) -> tuple[bytes, float]:
    """Send `data` on a fresh connection from `source`, read until the server closes it: (what came
    back, seconds from the last byte sent to the close)."""
    reader, writer = await asyncio.open_connection(CALLER, port, local_addr=(source, 0))
    try:
        writer.write(data)
        await writer.drain()
        start = time.monotonic()
        reply = await asyncio.wait_for(reader.read(), wait_s)
        return reply, time.monotonic() - start
    finally:
        writer.close()


async def _raw(port: int, data: bytes) -> int:
    """Send `data` on a fresh connection and read until the server closes it: the status it sent."""
    reply, _ = await _exchange(port, data)
    return (_statuses(reply) or [0])[0]


def _post_bytes(path: str, body: bytes, request_id: str = "") -> bytes:
    rid = f"x-request-id: {request_id}\r\n" if request_id else ""
    return (f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n{rid}"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


# ---------------------------------------------------------------------------------------------
# Traffic: the normal clients and the HTTP face's abusive kinds


async def _normal(run: Run) -> None:
    async with httpx.AsyncClient(base_url=run.base, timeout=120, headers=AUTH) as client:
        while run.running():
            start = time.perf_counter()
            reply = await client.post("/v1/chat/completions", json=NORMAL)
            run.phase.normal[reply.status_code] += 1
            if reply.status_code == 200:
                run.phase.latencies.append(time.perf_counter() - start)


async def _slow_head(run: Run) -> None:
    while run.running():
        status = await _raw(run.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nuser-agent: slo")
        run.count("slow_head", status)


async def _slow_body(run: Run) -> None:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-length: 1000\r\n"
            + f"authorization: Bearer {TOKEN}\r\n\r\n".encode())  # without it: 401 before the body
    while run.running():
        run.count("slow_body", await _raw(run.port, head + b'{"messages"'))


async def _large_body(run: Run) -> None:
    """32 MiB that is not JSON (read whole: 400), then 100 MiB declared (refused unread: 413; the
    client sends 1 MiB of it, the server drains that much, then closes)."""
    over = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-length: %d\r\n" % (100 << 20)
            + f"authorization: Bearer {TOKEN}\r\n\r\n".encode())
    async with httpx.AsyncClient(base_url=run.base, timeout=120, headers=AUTH) as client:
        while run.running():
            reply = await client.post("/v1/chat/completions", content=NOT_JSON)
            run.count("large_body", reply.status_code)
            run.count("large_body", await _raw(run.port, over + NOT_JSON[:1 << 20]))
            await asyncio.sleep(1.0)


async def _over_long(run: Run) -> None:
    async with httpx.AsyncClient(base_url=run.base, timeout=120, headers=AUTH) as client:
        while run.running():
            reply = await client.post("/v1/chat/completions", json=OVER_LONG)
            run.count("over_long", reply.status_code)
            await asyncio.sleep(0.1)


async def _slow_images(run: Run) -> None:
    parts = [{"type": "image_url", "image_url": {"url": run.upstream.url("/drip/2")}}] * 4
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Compare them."}]}],
            "max_tokens": 2}
    async with httpx.AsyncClient(base_url=run.base, timeout=120, headers=AUTH) as client:
        while run.running():
            reply = await client.post("/v1/chat/completions", json=body)
            run.count("slow_images", reply.status_code)


async def _made_up_methods(run: Run) -> None:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=run.base, timeout=30) as client:
        while run.running():
            method = "".join(rng.choices(string.ascii_uppercase, k=8))
            reply = await client.request(method, "/health")
            run.count("made_up_method", reply.status_code)
            await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# Issue 31: SGLang's routes


def _encode(req_id: str, item: str, host: str = CALLER, port: int | list[int] | None = None, **more: Any) -> dict:
    return {"req_id": req_id, "mm_items": [item], "num_parts": 1, "part_idx": 0, "modality": "IMAGE",
            "prefill_host": host, "embedding_port": port, **more}


def _register(req_id: str, url: str, **more: Any) -> dict:
    return {"req_id": req_id, "receive_count": 1, "receive_url": url, "modality": "IMAGE", **more}


def _destination_cases(run: Run) -> list[tuple[str, dict, str]]:
    """(route, body, the caller's address): each names a destination the default rule refuses."""
    good, bad, s = _data_url(PNG), NOT_AN_IMAGE, run.server
    own = [s.port, s.http_port, s.metrics_port, s.health_port]
    return [("/encode", _encode("dst-stranger", good, STRANGER, run.stranger.port), CALLER),
            ("/encode", _encode("dst-stranger-bad", bad, STRANGER, [run.stranger.port]), CALLER),
            ("/encode", _encode("dst-other-caller", bad, CALLER, run.silent.port), OTHER_HOST),
            ("/encode", _encode("dst-metadata", good, "169.254.169.254", 80), CALLER),
            *(("/encode", _encode(f"dst-own-{p}", bad, CALLER, p), CALLER) for p in own),
            ("/scheduler_receive_url", _register("dst-reg-stranger", f"{STRANGER}:{run.stranger.port}"), CALLER),
            ("/scheduler_receive_url", _register("dst-reg-other", f"{CALLER}:{run.silent.port}"), OTHER_HOST),
            ("/scheduler_receive_url", _register("dst-reg-own", f"{CALLER}:{s.port}"), CALLER)]


def _oversized_cases(run: Run) -> list[tuple[str, bytes]]:
    """(route, body), each a field over its bound; made once (the 8-MiB body takes a while to dump)."""
    good, port = _data_url(PNG), run.silent.port
    bodies = [("/encode", _encode("over-ports-65", good, port=list(range(20000, 20000 + MAX_PORTS + 1)))),
              ("/encode", _encode("over-ports-5000", good, port=list(range(1, 5001)))),
              ("/encode", _encode("r" * 257, good, port=port)),
              ("/encode", _encode("r" * 1_000_000, good, port=port)),
              ("/encode", _encode("over-num-parts", good, port=port, num_parts=10**30)),
              ("/scheduler_receive_url", _register("q" * (8 << 20), f"{CALLER}:{port}")),
              ("/scheduler_receive_url", _register("over-count", f"{CALLER}:{port}", receive_count=10**30))]
    return [(path, json.dumps(body).encode()) for path, body in bodies]


async def _epd_destinations(run: Run) -> None:
    """400 within AT_ONCE_S ("slow" otherwise): nothing is connected, not even an error report."""
    cases = _destination_cases(run)
    while run.running():
        for path, body, source in cases:
            reply, seconds = await _exchange(run.port, _post_bytes(path, json.dumps(body).encode()), source=source)
            status = (_statuses(reply) or [0])[0]
            run.count("epd_destination", status if seconds < AT_ONCE_S else "slow")
        await asyncio.sleep(PROBE_ROUND_S)


async def _epd_oversized(run: Run, cases: list[tuple[str, bytes]]) -> None:
    """400, and the answer small ("echoed" otherwise: a refused req_id is not sent back)."""
    while run.running():
        for path, body in cases:
            reply, _ = await _exchange(run.port, _post_bytes(path, body))
            status = (_statuses(reply) or [0])[0]
            run.count("epd_oversized", status if len(reply) < 2000 else "echoed")
        await asyncio.sleep(PROBE_ROUND_S)


async def _register_new_parts(run: Run, into: Counter, *, pause_s: float, until: Callable[[], bool]) -> None:
    """A new part each time, its rank on 127.0.0.1 (allowed), no /encode ever for it."""
    async with httpx.AsyncClient(base_url=run.base, timeout=30) as client:
        while until():
            body = _register(run.next_id("flood"), f"{CALLER}:{run.silent.port}")
            into[(await client.post("/scheduler_receive_url", json=body)).status_code] += 1
            await asyncio.sleep(pause_s)


async def fill_registrations(run: Run) -> Counter:
    """Before the warm-up (not measured): registrations until the table refuses (MAX_PARTS, then
    503), so that every phase runs beside a full table; 4 clients, as fast as they are answered."""
    got: Counter = Counter()

    def until_refused() -> bool:  # (or twice the bound taken: a table that never refuses ends the fill too)
        return not got[503] and got[200] < 2 * MAX_PARTS

    await asyncio.gather(*(_register_new_parts(run, got, pause_s=0, until=until_refused) for _ in range(4)))
    return got


async def _epd_registrations(run: Run) -> None:
    """The flood goes on beside a full table (10/s): 503, or 200 for a place an expiry freed."""
    await _register_new_parts(run, run.phase.abusive["epd_registration"], pause_s=0.2, until=run.running)


async def _epd_error_reports(run: Run) -> None:
    """Bad images whose destination is a black hole: each failure reports to it (MAX_ERROR_PUSHES at once)."""
    async with httpx.AsyncClient(base_url=run.base, timeout=30) as client:
        while run.running():
            body = _encode(run.next_id("bad"), NOT_AN_IMAGE, CALLER, run.error_hole.port)
            run.count("epd_error_report", (await client.post("/encode", json=body)).status_code)
            # Twice the error sockets' budget within the time each may hold one: it runs out.
            await asyncio.sleep(ERROR_SEND_TIMEOUT_S / (2 * MAX_ERROR_PUSHES))


async def _epd_black_hole_pushes(run: Run) -> None:
    """A good image pushed to a black hole of its own; the client leaves once the push connected
    (its status is then the access log's, read after the phase: 499)."""
    while run.running():
        hole = Recorder(CALLER)
        run.push_holes.append(hole)
        rid = run.next_id("black-hole")
        reader, writer = await asyncio.open_connection(CALLER, run.port)
        writer.write(_post_bytes("/encode", json.dumps(_encode(rid, _data_url(PNG), port=hole.port)).encode(), rid))
        answer = asyncio.ensure_future(reader.read())
        deadline = time.monotonic() + 30
        while not hole.peers and not answer.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if answer.done():  # answered before its push connected: that status is the outcome
            run.count("epd_black_hole_push", (_statuses(answer.result()) or [0])[0])
        else:
            run.phase.pushes_started += bool(hole.peers)
            run.phase.left.append(rid)
            answer.cancel()
        writer.close()
        await asyncio.sleep(4.0)


def _logged_statuses(server: ServeProcess, request_ids: list[str], timeout_s: float = 10.0) -> list[int | str]:
    """The access log's status of each request id ("unlogged" if none came within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {rid: status for status, rid in re.findall(r" status=(\d+) .* id=(\S+)$", server.log_text(), re.M)}
        if all(rid in found for rid in request_ids) or time.monotonic() > deadline:
            return [int(found[rid]) if rid in found else "unlogged" for rid in request_ids]
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# Issue 31: uuids, the producer's entries, framing, log forging


async def _uuids(run: Run) -> None:
    async with httpx.AsyncClient(base_url=run.base, timeout=60, headers=AUTH) as client:
        while run.running():
            for bad in BAD_UUIDS:
                part = {"type": "image_url", "image_url": {"url": _data_url(PNG)}, "uuid": bad}
                body = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}],
                        "max_tokens": 2}
                run.count("uuid", (await client.post("/v1/chat/completions", json=body)).status_code)
                await asyncio.sleep(PROBE_ROUND_S / len(BAD_UUIDS))


# Issue 32's routes: (method, path, body, the status it must get; `None` body: none sent).
IMAGE_PROMPT = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}
VLLM_ROUTES_REFUSED: list[tuple[str, str, Any, int]] = [
    ("POST", "/v1/completions", b"not json", 400),
    ("POST", "/v1/completions", [], 400),
    ("POST", "/v1/completions", {"prompt": None}, 400),
    ("POST", "/v1/completions", {"prompt": [[]]}, 400),
    ("POST", "/v1/completions", {"prompt": [-1]}, 400),
    ("POST", "/v1/completions", {"prompt": [2**70]}, 400),
    ("POST", "/v1/completions", {"prompt": ["a", [1]]}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400),
    ("POST", "/v1/completions", {"prompt": ["x"] * 1025}, 413),
    ("POST", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400),
    ("POST", "/v1/completions", {"prompt": IMAGE_PROMPT}, 400),
    ("POST", "/v1/completions", {"prompt": "<|media_pad|>"}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"bogus_key": 1}}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "allowed_token_ids": [10**6]}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404),
    ("GET", "/v1/completions", None, 405),
    ("POST", "/tokenize", {}, 400),
    ("POST", "/tokenize", {"prompt": 5}, 400),
    ("POST", "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400),
    ("POST", "/tokenize", {"messages": "hi"}, 400),
    ("POST", "/detokenize", {"tokens": [2**40]}, 400),
    ("POST", "/detokenize", {"tokens": "abc"}, 400),
    ("POST", "/version", None, 405),
    ("DELETE", "/metrics", None, 405),
]
VLLM_ROUTES_OK: list[tuple[str, str, Any, int]] = [
    ("POST", "/v1/completions", {"prompt": "Say hi.", "max_tokens": 2}, 200),
    ("POST", "/tokenize", {"prompt": "Say hi."}, 200),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}, 200),
    ("GET", "/version", None, 200),
    ("GET", "/metrics", None, 200),
]


async def _vllm_routes(run: Run) -> None:
    """Each case's status must be its own: another allowed status for another case still fails."""
    cases = [("vllm_routes_refused", case) for case in VLLM_ROUTES_REFUSED]
    cases += [("vllm_routes_ok", case) for case in VLLM_ROUTES_OK]
    async with httpx.AsyncClient(base_url=run.base, timeout=60, headers=AUTH) as client, \
            httpx.AsyncClient(base_url=run.base, timeout=60) as stranger:
        while run.running():
            for kind, (method, path, body, status) in cases:
                content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
                got = (await client.request(method, path, content=content)).status_code
                wrong = f"{got} for {method} {path} (expected {status})"
                run.count(kind, got if got == status or got >= 500 else wrong)  # a 5xx stays a number: no_5xx sees it
                await asyncio.sleep(PROBE_ROUND_S / (len(cases) + 1))
            got = (await stranger.post("/v1/completions", json={"prompt": "x"})).status_code
            run.count("vllm_routes_refused", got if got == 401 else f"{got} without the token (expected 401)")


def _producer_post(base: str, data: bytes, uuid: str | None = None) -> httpx.Response:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": _data_url(data)}}
    if uuid is not None:
        part["uuid"] = uuid
    return httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]},
                      headers=AUTH, timeout=120)


def _first_entry(producer: ServeProcess, export_dir: Path) -> dict[str, Any]:
    """Write PNG under a named uuid and under its own key (before any phase), and keep their bytes."""
    base = f"http://127.0.0.1:{producer.http_port}"
    named = _producer_post(base, PNG, "hostile-first-writer")
    own = _producer_post(base, PNG)
    if named.status_code != 200 or own.status_code != 200:
        raise RuntimeError(f"the producer did not write its first entries: {named.text} {own.text}")
    (key,) = own.json()["ec_transfer_params"]
    files = {name: export_dir / name / "encoder_cache.safetensors" for name in ("hostile-first-writer", key)}
    return {"key": key, "files": files, "bytes": {name: path.read_bytes() for name, path in files.items()},
            "dir": export_dir, "entries": sorted(os.listdir(export_dir))}


async def _ec_entries(run: Run) -> None:
    """Another image under the named uuid, under the first image's own key, under a made-up hash: 400."""
    foreign = ["hostile-first-writer", run.entry["key"], "ab" * 32]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{run.producer.http_port}", timeout=120,
                                 headers=AUTH) as client:
        while run.running():
            for uuid in foreign:
                part = {"type": "image_url", "image_url": {"url": _data_url(OTHER_PNG)}, "uuid": uuid}
                reply = await client.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                                    "content": [part]}]})
                run.count("ec_entry", reply.status_code)
                await asyncio.sleep(PROBE_ROUND_S / len(foreign))


CHUNKED_BODY = b"2\r\n{}\r\n0\r\n\r\n"
FRAMING_HEADS = [  # each a head a proxy in front could frame otherwise than this server
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 42\r\ntransfer-encoding: chunked\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-note: a\r\n transfer-encoding: chunked\r\n",  # obs-fold
    b"GET /v1/models HTTP/1.1\nhost: x\n",  # bare LF
    b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-note: a\rb\r\n",  # bare CR
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ncontent-length: 42\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n",
]


async def _framing(run: Run) -> None:
    """Each head with a token, then a chunked body and a smuggled `GET /v1/models` (which would be
    a 200) in one write: every answer counts, so an answered smuggled request is a 200 here; a
    connection not closed within CLOSED_WITHIN_S is "open"."""
    auth = f"authorization: Bearer {TOKEN}\r\n".encode()
    while run.running():
        for head in FRAMING_HEADS:
            newline = b"\n" if b"\r" not in head else b"\r\n"
            smuggled = (f"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-request-id: {run.next_id('smuggled')}\r\n"
                        .encode() + auth + b"\r\n")
            reply, seconds = await _exchange(run.port, head + auth.replace(b"\r\n", newline) + newline
                                             + CHUNKED_BODY + smuggled, wait_s=10)
            for status in _statuses(reply) or [0]:
                run.count("framing", status)
            if seconds > CLOSED_WITHIN_S:
                run.count("framing", "open")
        await asyncio.sleep(PROBE_ROUND_S)


async def _log_forging(run: Run) -> None:
    """No token, so the refusal's warning names the path: CR LF and a whole record in it."""
    while run.running():
        request = f"GET {FORGING_PATH} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode()
        run.count("log_forging", await _raw(run.port, request))
        await asyncio.sleep(PROBE_ROUND_S / 3)


# ---------------------------------------------------------------------------------------------
# Issue 31: the side doors (health, gRPC, /metrics)


def _channel(port: int) -> grpc.aio.Channel:
    """A channel on a TCP connection of its own (channels to one target otherwise share one)."""
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])


async def _watch(channel: grpc.aio.Channel) -> tuple[grpc.aio.Call, str]:
    """Open a Watch and read its first message: ("SERVING", ...) or the refusal's status name."""
    call = channel.unary_stream(WATCH, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                response_deserializer=health_pb2.HealthCheckResponse.FromString)(
        health_pb2.HealthCheckRequest(service=""), timeout=120)
    try:
        return call, health_pb2.HealthCheckResponse.ServingStatus.Name((await call.read()).status)
    except grpc.aio.AioRpcError as exc:
        return call, exc.code().name


async def _check(port: int) -> str:
    async with _channel(port) as channel:
        check = channel.unary_unary(CHECK, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        try:
            reply = await check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def _watch_flood(run: Run, connections: int, each: int, hold_s: float, ramp_s: float = 0.0) -> dict:
    """`connections` connections of `each` Watch streams to the health port, opened one after
    another over `ramp_s`, held `hold_s` while Check is asked on both ports, then ended. What each
    connection got."""
    channels = [_channel(run.server.health_port) for _ in range(connections)]
    per_channel: list[list[tuple[grpc.aio.Call, str]]] = []
    start = time.monotonic()
    try:
        for channel in channels:
            per_channel.append([await _watch(channel) for _ in range(each)])
            await asyncio.sleep(ramp_s / connections)
        opened_s = time.monotonic() - start
        for name, outcomes in (("health_watch", [o for got in per_channel for _, o in got]),
                               ("health_check", [await _check(run.server.health_port), await _check(run.server.port)])):
            for outcome in outcomes:
                run.count(name, outcome)
        await asyncio.sleep(hold_s)
    finally:
        for got in per_channel:
            for call, _ in got:
                call.cancel()
        for channel in channels:
            await channel.close()
    serving = [sum(o == "SERVING" for _, o in got) for got in per_channel]
    return {"asked": connections * each, "serving": sum(serving), "most_on_one_connection": max(serving),
            "opened_in_s": round(opened_s, 1)}


async def _health_watches(run: Run) -> None:
    """Over both bounds at the start of the phase, then over the per-connection bound every 5 s."""
    run.phase.watch_floods.append(await _watch_flood(run, *WATCH_FLOOD, hold_s=2.0, ramp_s=WATCH_RAMP_S))
    while run.running(5.0):
        await asyncio.sleep(5.0)
        await _watch_flood(run, 1, MAX_WATCHES_PER_CONNECTION + 4, hold_s=0.5)


async def _not_protobuf(run: Run) -> None:
    """Every method of every service on the main port (with the token: the guard, not auth, must
    answer), Check and Watch on the health port."""
    targets = [(run.server.port, method) for method in [*VISION, CHECK, WATCH, REFLECTION]]
    targets += [(run.server.health_port, method) for method in (CHECK, WATCH)]
    async with _channel(run.server.port) as main, _channel(run.server.health_port) as health:
        channels = {run.server.port: main, run.server.health_port: health}
        while run.running():
            for port, method in targets:
                # A stream of one message reaches every kind of method as it expects (the wire is the same).
                call = channels[port].stream_stream(method)(iter([NOT_PROTOBUF]), timeout=30,
                                                            metadata=(("authorization", f"Bearer {TOKEN}"),))
                run.count("not_protobuf", (await call.code()).name)
            await asyncio.sleep(PROBE_ROUND_S)


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1 << 16), 0.05) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


async def _metrics_idle(run: Run) -> None:
    """IDLE_METRICS_CONNECTIONS that send nothing; a scrape beside them; each closed within the idle timeout + 1 s."""
    cycle_s = IDLE_TIMEOUT_S + 2
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        while run.running(cycle_s):
            idle = [await asyncio.open_connection(CALLER, run.server.metrics_port)
                    for _ in range(IDLE_METRICS_CONNECTIONS)]
            try:
                await asyncio.sleep(0.5)
                scrape = await client.get(f"http://127.0.0.1:{run.server.metrics_port}/metrics")
                run.count("metrics_scrape", scrape.status_code)
                await asyncio.sleep(IDLE_TIMEOUT_S + 1)
                for reader, _ in idle:
                    run.count("metrics_idle", "closed" if await _closed_by_server(reader) else "open")
            finally:
                for _, writer in idle:
                    writer.close()


# ---------------------------------------------------------------------------------------------
# A phase


def _open_files(server: ServeProcess) -> int:
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


def _threads(server: ServeProcess) -> int:
    return len(os.listdir(f"/proc/{server.proc.pid}/task"))


def _cpu_seconds(run: Run) -> dict[str, float]:
    """CPU seconds so far: the server process with its encoder workers, the producer's, the bench's
    own (all share this machine's cores: what the bench spends, the server cannot)."""
    def tree(server: ServeProcess) -> float:
        total = 0.0
        for process in [server.process, *server.process.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):  # a helper process that just ended
                total += sum(process.cpu_times()[:2])
        return total

    own = os.times()
    return {"server": tree(run.server), "producer": tree(run.producer), "bench": own.user + own.system}


async def _sample(run: Run, done: asyncio.Event) -> None:
    while not done.is_set():
        run.phase.fds.append(_open_files(run.server))
        run.phase.threads.append(_threads(run.server))
        await asyncio.sleep(0.1)


def _abusive_kinds(run: Run, oversized: list[tuple[str, bytes]]) -> list[Coroutine]:
    kinds: list[Callable[[Run], Coroutine]] = [
        *[_slow_head] * 8, *[_slow_body] * 2, _large_body, _over_long, _slow_images, _made_up_methods,
        _epd_destinations, _epd_registrations, _epd_error_reports, _epd_black_hole_pushes,
        _uuids, _ec_entries, _framing, _log_forging, _health_watches, _not_protobuf, _metrics_idle,
        _vllm_routes]
    return [kind(run) for kind in kinds] + [_epd_oversized(run, oversized)]


async def run_phase(run: Run, seconds: float, clients: int, *, abusive: bool,
                    oversized: list[tuple[str, bytes]]) -> Phase:
    run.phase, run.stop_at = Phase(log_from=len(run.server.log_text())), time.monotonic() + seconds
    run.phase.fds.append(_open_files(run.server))  # the first sample: the phase's start
    run.phase.threads.append(_threads(run.server))
    done = asyncio.Event()
    sampler = asyncio.ensure_future(_sample(run, done))
    cpu = _cpu_seconds(run)
    start = time.monotonic()
    abuse = asyncio.gather(*_abusive_kinds(run, oversized)) if abusive else None
    await asyncio.gather(*(_normal(run) for _ in range(clients)))
    run.phase.seconds = time.monotonic() - start
    if abuse is not None:
        await abuse
    done.set()
    await sampler
    run.phase.cpu_s = {name: round(after - cpu[name], 1) for name, after in _cpu_seconds(run).items()}
    for status in await asyncio.to_thread(_logged_statuses, run.server, run.phase.left):
        run.count("epd_black_hole_push", status)
    return run.phase


# ---------------------------------------------------------------------------------------------
# Server measurements


def _metrics(server: ServeProcess) -> str:
    return httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).text


def _series(text: str) -> set[str]:
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def _settled_rss(server: ServeProcess, pause_s: float = 2.0) -> int:
    time.sleep(pause_s)
    return server.rss()


async def _trimmed_rss(run: Run) -> int:
    """The settled RSS once the server has handed its free heap back: it does so (malloc_trim) a
    moment after RELEASE_AFTER_WATCHES Watch streams have ended, which the floods also set off at
    whatever time they end, so an untrimmed reading holds more or less free memory by chance (two
    runs on 2026-12-04: -5.3 % and -5.8 %, all of it anonymous memory, RssFile unchanged). Both
    readings are taken this way, so the drift is the memory the server still holds."""
    phase, run.phase = run.phase, Phase()  # these streams are not the phase's traffic
    try:
        connections = -(-RELEASE_AFTER_WATCHES // MAX_WATCHES_PER_CONNECTION)
        await _watch_flood(run, connections, MAX_WATCHES_PER_CONNECTION, hold_s=0.0)
    finally:
        run.phase = phase
    return _settled_rss(run.server, RELEASE_DELAY_S + 2.0)


def _rss_parts(server: ServeProcess) -> dict[str, float]:
    """The resident set's anonymous and file-backed parts, MiB (a file-backed page, such as the
    mapped checkpoint's, leaves it when the kernel reclaims page cache for other processes)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines())
    return {name: round(int(fields[name].split()[0]) / 1024, 1) for name in ("RssAnon", "RssFile", "RssShmem")}


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def _read_answer(sock: socket.socket) -> int:
    """One answer with a Content-Length body from `sock`: its status."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(1 << 16)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))
    while len(rest) < length:
        rest += sock.recv(1 << 16)
    return int(head.split()[1])


def kept_alive_ms(port: int, times: int = 20) -> tuple[float, float]:
    """Medians of `times` `GET /v1/models`: on one kept-alive connection (after its first request),
    and each on a fresh connection (its connect included)."""
    request = f"GET /v1/models HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer {TOKEN}\r\n\r\n".encode()

    def round_trip(sock: socket.socket) -> float:
        start = time.perf_counter()
        sock.sendall(request)
        if _read_answer(sock) != 200:
            raise RuntimeError("GET /v1/models was not answered 200")
        return time.perf_counter() - start

    fresh = []
    for _ in range(times):
        start = time.perf_counter()
        with socket.create_connection((CALLER, port), timeout=10) as sock:
            round_trip(sock)
        fresh.append(time.perf_counter() - start)
    with socket.create_connection((CALLER, port), timeout=10) as sock:
        round_trip(sock)  # a connection's first request is the fresh case
        kept = [round_trip(sock) for _ in range(times)]
    return statistics.median(kept) * 1e3, statistics.median(fresh) * 1e3


def _codes(counter: Counter) -> dict[str, int]:
    return {str(code): n for code, n in counter.items()}


def summarise(base: Phase, abusive: Phase, warmup: Phase | None, run: Run, rss: dict[str, int],
              metrics: dict[str, str], kept_alive: tuple[float, float]) -> dict:
    def phase_report(phase: Phase) -> dict:
        return {"seconds": round(phase.seconds, 1), "normal_ok": len(phase.latencies),
                "normal_rps": round(len(phase.latencies) / phase.seconds, 2),
                "p50_ms": round(_percentile(phase.latencies, 50), 1),
                "p99_ms": round(_percentile(phase.latencies, 99), 1),
                "normal_codes": _codes(phase.normal),
                "abusive_codes": {kind: _codes(codes) for kind, codes in phase.abusive.items() if codes},
                "open_files": {"start": phase.fds[0], "peak": max(phase.fds)},
                "threads": {"start": phase.threads[0], "peak": max(phase.threads)}, "cpu_s": phase.cpu_s}

    phases = [p for p in (warmup, base, abusive) if p is not None]
    ratio = _percentile(abusive.latencies, 99) / _percentile(base.latencies, 99)
    # Every 5xx fails, but the one a kind expects: 503 for a registration beyond MAX_PARTS (retryable).
    counters = [(EXPECTED[kind], codes) for phase in phases for kind, codes in phase.abusive.items()]
    counters += [(set(), phase.normal) for phase in phases] + [(EXPECTED["epd_registration"], run.filled)]
    five_xx = sorted({code for allowed, codes in counters for code in codes
                      if isinstance(code, int) and code >= 500 and code not in allowed})
    unexpected = {kind: sorted(map(str, set(codes) - EXPECTED[kind])) for kind, codes in abusive.abusive.items()
                  if set(codes) - EXPECTED[kind]}
    missing = {kind: sorted(map(str, need - set(abusive.abusive[kind]))) for kind, need in REQUIRED.items()
               if need - set(abusive.abusive[kind])}
    drift = rss["after_abusive"] / rss["before_abusive"] - 1
    added = sorted(_series(metrics["after_abusive"]) - _series(metrics["before"]))
    # Open files the bounds allow over the phase's start: two per ZMQ socket (its TCP connection and
    # its mailbox) for every error report and every push the phase began, one per connection held.
    fd_bound = (abusive.fds[0] + 2 * (MAX_ERROR_PUSHES + abusive.pushes_started) + MAX_CONNECTIONS + WATCH_FLOOD[0]
                + BENCH_HTTP_CONNECTIONS + FD_SLACK)
    log = run.server.log_text()
    forged = [line for line in log.splitlines() if line.startswith(FORGED)]
    registrations = [run.filled, *(phase.abusive["epd_registration"] for phase in phases)]
    registered, asked = sum(c[200] for c in registrations), sum(sum(c.values()) for c in registrations)
    floods = abusive.watch_floods + (warmup.watch_floods if warmup else [])
    kept_ms, fresh_ms = kept_alive
    entry = run.entry
    checks = {
        "p99_within_2x": ratio <= P99_RATIO_LIMIT,
        "no_5xx_unexpected": not five_xx,
        "normal_all_ok": set(base.normal) == set(abusive.normal) == {200},
        "abusive_as_expected": not unexpected and not missing and all(abusive.abusive[kind] for kind in EXPECTED),
        "rss_drift_under_5pct": abs(drift) < RSS_DRIFT_LIMIT,
        "metrics_series_unchanged": not added,
        "open_files_bounded": max(abusive.fds) <= fd_bound,
        "threads_bounded": max(abusive.threads) <= abusive.threads[0] + THREAD_SLACK,
        "watches_bounded": bool(floods) and all(f["serving"] <= MAX_WATCHES and f["serving"] < f["asked"]
                                                and f["most_on_one_connection"] <= MAX_WATCHES_PER_CONNECTION
                                                for f in floods),
        "no_connection_to_refused_destinations": not run.stranger.peers and not run.silent.peers,
        "error_reports_over_their_budget_dropped": DROPPED_REPORTS in log[abusive.log_from:],
        # Valid while no registration can have expired (the run is shorter than REGISTRATION_TIMEOUT_S).
        "registrations_bounded": registered <= MAX_PARTS and (asked <= MAX_PARTS or registered < asked),
        "no_smuggled_request_handled": "smuggled-" not in log,
        "no_forged_log_line": not forged,
        "ec_entries_kept": sorted(os.listdir(entry["dir"])) == entry["entries"]
        and all(path.read_bytes() == entry["bytes"][name] for name, path in entry["files"].items()),
        "kept_alive_within_2ms": kept_ms <= fresh_ms + KEPT_ALIVE_LIMIT_MS,
    }
    report = {"baseline": phase_report(base), "abusive": phase_report(abusive), "p99_ratio": round(ratio, 3),
              "unexpected_codes": unexpected, "missing_codes": missing, "unexpected_5xx": five_xx,
              "rss_mib": {name: round(value / 2**20, 1) for name, value in rss.items()}, "rss_drift": round(drift, 4),
              "rss_parts_mib": run.rss_parts,
              "metrics": {"bytes": {name: len(text) for name, text in metrics.items()},
                          "series": {name: len(_series(text)) for name, text in metrics.items()},
                          "series_added_by_abuse": added[:20]},
              "open_files_bound": fd_bound, "pushes_started": abusive.pushes_started,
              "watch_floods": floods, "registrations": {"filling": _codes(run.filled), "asked": asked,
                                                        "answered_200": registered},
              "recorded_connections": {"stranger": len(run.stranger.peers), "silent": len(run.silent.peers)},
              "forged_lines": forged[:3],
              "kept_alive_ms": {"kept_alive": round(kept_ms, 2), "fresh": round(fresh_ms, 2)},
              "checks": checks}
    if warmup is not None:
        report["warmup"] = phase_report(warmup)
    return report


def print_report(report: dict) -> None:
    for name in ("baseline", "abusive"):
        r = report[name]
        print(f"{name:>8}: {r['seconds']:.0f} s, normal {r['normal_ok']} OK ({r['normal_rps']}/s), "
              f"p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms; normal codes {r['normal_codes']}; "
              f"open files {r['open_files']}, threads {r['threads']}; CPU s {r['cpu_s']}")
        for kind, codes in r["abusive_codes"].items():
            print(f"          {kind}: {codes}")
    rss, m = report["rss_mib"], report["metrics"]
    print(f"p99 abusive / baseline: {report['p99_ratio']:.2f}x")
    print(f"server RSS MiB (settled): {rss}; drift over the abusive run {report['rss_drift'] * 100:+.2f} %; "
          f"parts {report['rss_parts_mib']}")
    print(f"/metrics bytes {m['bytes']}, series {m['series']}; added by the abuse: {m['series_added_by_abuse']}")
    print(f"open files bound {report['open_files_bound']} (pushes begun {report['pushes_started']}); "
          f"Watch floods {report['watch_floods']}; registrations {report['registrations']}")
    print(f"connections to refused destinations {report['recorded_connections']}; "
          f"forged lines {report['forged_lines']}")
    k = report["kept_alive_ms"]
    print(f"GET /v1/models median of 20: kept alive {k['kept_alive']} ms, fresh connection {k['fresh']} ms")
    print("checks:", report["checks"])


async def _phases(run: Run, args: argparse.Namespace) -> tuple[Phase | None, Phase, Phase, dict, dict, tuple]:
    oversized = _oversized_cases(run)
    run.filled = await fill_registrations(run)
    warmup = None
    if args.warmup_seconds > 0:
        warmup = await run_phase(run, args.warmup_seconds, args.clients, abusive=True, oversized=oversized)
    metrics = {"before": _metrics(run.server)}
    base = await run_phase(run, args.seconds, args.clients, abusive=False, oversized=oversized)
    rss = {"before_abusive_untrimmed": _settled_rss(run.server)}
    rss["before_abusive"] = await _trimmed_rss(run)
    run.rss_parts = {"before_abusive": _rss_parts(run.server)}
    abusive = await run_phase(run, args.seconds, args.clients, abusive=True, oversized=oversized)
    rss["after_abusive_untrimmed"] = _settled_rss(run.server)
    rss["after_abusive"] = await _trimmed_rss(run)
    run.rss_parts["after_abusive"] = _rss_parts(run.server)
    metrics["after_abusive"] = _metrics(run.server)
    kept = kept_alive_ms(run.server.http_port)
    return warmup, base, abusive, rss, metrics, kept


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="each measured phase (default 60)")
    p.add_argument("--warmup-seconds", type=float, default=30.0, help="warm-up with every kind (default 30)")
    p.add_argument("--clients", type=int, default=2, help="normal clients (default 2)")
    p.add_argument("--max-concurrency", type=int, default=2, help="for the server (default 2)")
    p.add_argument("--devices", default="cpu:1", help="for the server (default cpu:1)")
    p.add_argument("--server-log", help="write the server's log here (default: a temporary file)")
    p.add_argument("--json", help="also write the report as JSON here")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.clients < 1:
        p.error("--seconds must be > 0 and --clients >= 1")
    if args.warmup_seconds + 2 * args.seconds + 30 > REGISTRATION_TIMEOUT_S:
        print(f"note: a run this long lets registrations expire ({REGISTRATION_TIMEOUT_S:g} s): "
              "registrations_bounded can then fail without a fault", file=sys.stderr)

    log = Path(args.server_log or tempfile.mkstemp(prefix="kimi-vision-hostile-", suffix=".log")[1])
    work = Path(tempfile.mkdtemp(prefix="kimi-vision-hostile-"))
    serve = ["--devices", args.devices, "--http-port", "0", "--metrics-port", "0", "--health-port", "0",
             "--max-concurrency", str(args.max_concurrency), "--max-queue", "32", "--max-model-len", str(MODEL_LEN),
             "--allow-remote-images", "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "5",
             "--http-header-timeout", str(TIMEOUT_S), "--http-body-timeout", str(TIMEOUT_S),
             "--drain-seconds", "5"]  # pushes to the black holes never end: the drain need not wait for them
    producer_args = ["--devices", args.devices, "--http-port", "0", "--ec-role", "producer",
                     "--ec-export-dir", str(work / "ec"), "--max-concurrency", "1"]
    listeners = [Recorder(STRANGER), Recorder(CALLER), Recorder(CALLER)]
    push_holes: list[Recorder] = []
    try:
        with (ImageUpstream(PNG) as upstream,
              ServeProcess.start(serve, log_path=log, env={ENV_VAR: TOKEN}) as server,
              ServeProcess.start(producer_args, log_path=work / "producer.log",
                                 env={ENV_VAR: TOKEN}) as producer):
            run = Run(server, producer, upstream, *listeners, push_holes=push_holes,
                      entry=_first_entry(producer, work / "ec"))
            warmup, base, abusive, rss, metrics, kept = asyncio.run(_phases(run, args))
            exit_code = server.terminate()
            report = summarise(base, abusive, warmup, run, rss, metrics, kept)
    finally:
        for listener in listeners + push_holes:
            listener.close()
    report["server_exit_code"] = exit_code
    report["server_log"] = str(log)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    failed = [name for name, ok in report["checks"].items() if not ok] + (["server_exit"] if exit_code else [])
    if failed:
        print("failed:", failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
