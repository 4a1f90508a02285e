"""Normal traffic beside an abusive mix, against a real `kimi-vision serve` on 127.0.0.1 (HTTP face).

    .venv/bin/python -m bench.hostile --seconds 60 [--json OUT.json]

Starts the server (HTTP face and /metrics; `--max-model-len 4096`; remote images allowed from the
bench's own image upstream on 127.0.0.1; 2-s HTTP timeouts) and the upstream, then runs:

1. a warm-up (`--warmup-seconds`): normal traffic and every abusive kind, so that every metric
   label the run can make exists and the allocators reach their working size (not measured);
2. the baseline: `--clients` normal clients for `--seconds`;
3. the abusive run: the same normal clients for `--seconds`, beside the abusive mix.

A normal request is a chat completion with a 64x48 PNG as a data: URL, `max_tokens` 8, not
streamed, sent back to back by each client. The abusive mix, each kind on its own connections:
slow heads (8 at a time, the request line and half a header, then nothing: 408), slow bodies (2 at
a time, 10 bytes of 1,000: 408), large bodies (once a second: 32 MiB that is not JSON, read whole:
400; 100 MiB declared, over the message limit, of which 1 MiB is sent: 413), over-long prompts (20
KB of text, ~14k tokens, over the model length: 400, 10/s), slow remote images (4 images, each
dripped over 2 s by the upstream, fetched at once: 200), made-up methods (20/s against /health: 405).

Checks (exit 1 if one fails): the normal requests' p99 in the abusive run within 2x the
baseline's; no 5xx answer at all (normal or abusive, either phase); every abusive request got its
expected status; the server's RSS, settled (read after 2 s without traffic), drifts less than 5 %
over the abusive run; the abusive run adds no /metrics series (names and labels; the byte size is
reported: counters grow a digit now and then).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import string
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from tests.image_upstream import ImageUpstream
from tests.serve_process import ServeProcess

MODEL_LEN = 4096
TIMEOUT_S = 2.0  # the server's header and body timeouts
P99_RATIO_LIMIT = 2.0
RSS_DRIFT_LIMIT = 0.05
# What each abusive kind must get; anything else fails the run.
EXPECTED = {"slow_head": {408}, "slow_body": {408}, "large_body": {400, 413}, "over_long": {400},
            "slow_images": {200}, "made_up_method": {405}}


def _png(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


PNG = _png(64, 48)
NORMAL = {"messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()}},
    {"type": "text", "text": "What is in the picture?"}]}], "max_tokens": 8}
OVER_LONG = {"messages": [{"role": "user", "content": "Lorem ipsum dolor sit amet. " * 730}], "max_tokens": 8}
NOT_JSON = b"x" * (32 << 20)  # under the 64 MiB message limit: read whole, then refused


@dataclass
class Phase:
    latencies: list[float] = field(default_factory=list)  # normal requests answered 200, seconds
    normal: Counter = field(default_factory=Counter)  # normal requests by status
    abusive: dict[str, Counter] = field(default_factory=lambda: {kind: Counter() for kind in EXPECTED})
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------
# Traffic


async def _normal(base: str, phase: Phase, stop_at: float) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            reply = await client.post("/v1/chat/completions", json=NORMAL)
            phase.normal[reply.status_code] += 1
            if reply.status_code == 200:
                phase.latencies.append(time.perf_counter() - start)


async def _raw(port: int, data: bytes) -> int:
    """Send `data` on a fresh connection and read until the server closes it: the status it sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        reply = await reader.read()
    finally:
        writer.close()
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


async def _slow_head(port: int, phase: Phase, stop_at: float) -> None:
    while time.monotonic() < stop_at:
        status = await _raw(port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nuser-agent: slo")
        phase.abusive["slow_head"][status] += 1


async def _slow_body(port: int, phase: Phase, stop_at: float) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-length: 1000\r\n\r\n"
    while time.monotonic() < stop_at:
        status = await _raw(port, head + b'{"messages"')
        phase.abusive["slow_body"][status] += 1


async def _large_body(base: str, port: int, phase: Phase, stop_at: float) -> None:
    """32 MiB that is not JSON (read whole: 400), then 100 MiB declared (refused unread: 413; the
    client sends 1 MiB of it, the server drains that much, then closes)."""
    over = b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-length: %d\r\n\r\n" % (100 << 20)
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        while time.monotonic() < stop_at:
            reply = await client.post("/v1/chat/completions", content=NOT_JSON)
            phase.abusive["large_body"][reply.status_code] += 1
            phase.abusive["large_body"][await _raw(port, over + NOT_JSON[:1 << 20])] += 1
            await asyncio.sleep(1.0)


async def _over_long(base: str, phase: Phase, stop_at: float) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        while time.monotonic() < stop_at:
            reply = await client.post("/v1/chat/completions", json=OVER_LONG)
            phase.abusive["over_long"][reply.status_code] += 1
            await asyncio.sleep(0.1)


async def _slow_images(base: str, upstream: ImageUpstream, phase: Phase, stop_at: float) -> None:
    parts = [{"type": "image_url", "image_url": {"url": upstream.url("/drip/2")}}] * 4
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Compare them."}]}],
            "max_tokens": 2}
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        while time.monotonic() < stop_at:
            reply = await client.post("/v1/chat/completions", json=body)
            phase.abusive["slow_images"][reply.status_code] += 1


async def _made_up_methods(base: str, phase: Phase, stop_at: float) -> None:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        while time.monotonic() < stop_at:
            method = "".join(rng.choices(string.ascii_uppercase, k=8))
            reply = await client.request(method, "/health")
            phase.abusive["made_up_method"][reply.status_code] += 1
            await asyncio.sleep(0.05)


async def run_phase(server: ServeProcess, upstream: ImageUpstream, seconds: float, clients: int, *,
                    abusive: bool) -> Phase:
    phase = Phase()
    base, port = f"http://127.0.0.1:{server.http_port}", server.http_port
    stop_at = time.monotonic() + seconds
    tasks = [_normal(base, phase, stop_at) for _ in range(clients)]
    if abusive:
        tasks += [_slow_head(port, phase, stop_at) for _ in range(8)]
        tasks += [_slow_body(port, phase, stop_at) for _ in range(2)]
        tasks += [_large_body(base, port, phase, stop_at), _over_long(base, phase, stop_at),
                  _slow_images(base, upstream, phase, stop_at), _made_up_methods(base, phase, stop_at)]
    start = time.monotonic()
    await asyncio.gather(*tasks)
    phase.seconds = time.monotonic() - start
    return phase


# ---------------------------------------------------------------------------------------------
# Server measurements


def _metrics(server: ServeProcess) -> str:
    return httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).text


def _series(text: str) -> set[str]:
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def _settled_rss(server: ServeProcess, pause_s: float = 2.0) -> int:
    time.sleep(pause_s)
    return server.rss()


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def summarise(base: Phase, abusive: Phase, rss: dict[str, int], metrics: dict[str, str]) -> dict:
    def phase_report(phase: Phase) -> dict:
        return {"seconds": round(phase.seconds, 1), "normal_ok": len(phase.latencies),
                "normal_rps": round(len(phase.latencies) / phase.seconds, 2),
                "p50_ms": round(_percentile(phase.latencies, 50), 1),
                "p99_ms": round(_percentile(phase.latencies, 99), 1),
                "normal_codes": dict(phase.normal),
                "abusive_codes": {kind: dict(codes) for kind, codes in phase.abusive.items() if codes}}

    ratio = _percentile(abusive.latencies, 99) / _percentile(base.latencies, 99)
    statuses = [code for phase in (base, abusive) for counter in (phase.normal, *phase.abusive.values())
                for code in counter]
    unexpected = {kind: sorted(set(codes) - EXPECTED[kind]) for kind, codes in abusive.abusive.items()
                  if set(codes) - EXPECTED[kind]}
    drift = rss["after_abusive"] / rss["before_abusive"] - 1
    added = sorted(_series(metrics["after_abusive"]) - _series(metrics["before"]))
    checks = {
        "p99_within_2x": ratio <= P99_RATIO_LIMIT,
        "no_5xx": not any(code >= 500 for code in statuses),
        "normal_all_ok": set(base.normal) == set(abusive.normal) == {200},
        "abusive_as_expected": not unexpected and all(abusive.abusive[kind] for kind in EXPECTED),
        "rss_drift_under_5pct": abs(drift) < RSS_DRIFT_LIMIT,
        "metrics_series_unchanged": not added,
    }
    return {"baseline": phase_report(base), "abusive": phase_report(abusive), "p99_ratio": round(ratio, 3),
            "unexpected_codes": unexpected,
            "rss_mib": {name: round(value / 2**20, 1) for name, value in rss.items()}, "rss_drift": round(drift, 4),
            "metrics": {"bytes": {name: len(text) for name, text in metrics.items()},
                        "series": {name: len(_series(text)) for name, text in metrics.items()},
                        "series_added_by_abuse": added[:20]},
            "checks": checks}


def print_report(report: dict) -> None:
    for name in ("baseline", "abusive"):
        r = report[name]
        print(f"{name:>8}: {r['seconds']:.0f} s, normal {r['normal_ok']} OK ({r['normal_rps']}/s), "
              f"p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms; normal codes {r['normal_codes']}")
        for kind, codes in r["abusive_codes"].items():
            print(f"          {kind}: {codes}")
    rss, m = report["rss_mib"], report["metrics"]
    print(f"p99 abusive / baseline: {report['p99_ratio']:.2f}x")
    print(f"server RSS MiB (settled): {rss}; drift over the abusive run {report['rss_drift'] * 100:+.2f} %")
    print(f"/metrics bytes {m['bytes']}, series {m['series']}; added by the abuse: {m['series_added_by_abuse']}")
    print("checks:", report["checks"])


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

    log = Path(args.server_log or tempfile.mkstemp(prefix="kimi-vision-hostile-", suffix=".log")[1])
    serve = ["--devices", args.devices, "--http-port", "0", "--metrics-port", "0", "--max-concurrency",
             str(args.max_concurrency), "--max-queue", "32", "--max-model-len", str(MODEL_LEN),
             "--allow-remote-images", "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "5",
             "--http-header-timeout", str(TIMEOUT_S), "--http-body-timeout", str(TIMEOUT_S)]
    with ImageUpstream(PNG) as upstream, ServeProcess.start(serve, log_path=log) as server:
        if args.warmup_seconds > 0:
            asyncio.run(run_phase(server, upstream, args.warmup_seconds, args.clients, abusive=True))
        metrics = {"before": _metrics(server)}
        base = asyncio.run(run_phase(server, upstream, args.seconds, args.clients, abusive=False))
        rss = {"before_abusive": _settled_rss(server)}
        abusive = asyncio.run(run_phase(server, upstream, args.seconds, args.clients, abusive=True))
        rss["after_abusive"] = _settled_rss(server)
        metrics["after_abusive"] = _metrics(server)
        exit_code = server.terminate()
    report = summarise(base, abusive, rss, metrics)
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
