"""The checks deploy/docker/smoke.sh runs with the image's own Python (this file arrives on stdin):

    python - serve HOST   the server in another container answers on every port, as the node would reach it
    python - logs CPUS    every line of its log (stdin after this file: `docker logs` of both streams) is one
                          JSON object, and the thread defaults it logged follow a quota of CPUS

Each check prints one line; the first failure exits 1 naming it.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import sys
import time

# The Kubernetes CPU Deployment's ports (deploy/kubernetes/cpu/deployment.yaml) and the HTTP face's.
GRPC, HEALTH, METRICS, HTTP = 50051, 50052, 9090, 8000
READY_TIMEOUT_S = 300.0


def fail(message: str) -> None:
    print(f"FAIL: {message}", flush=True)
    sys.exit(1)


def tiny_png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 80, 40)).save(buf, "PNG")
    return buf.getvalue()


def serve(host: str) -> None:
    import grpc
    import httpx

    from service.rpc.client import SERVICE_NAME, VisionClient

    deadline = time.monotonic() + READY_TIMEOUT_S
    with VisionClient(f"{host}:{HEALTH}", timeout=5) as probe:
        while True:  # as the startupProbe: until the plaintext health port says SERVING
            try:
                if probe.health(SERVICE_NAME) == "SERVING":
                    break
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                fail(f"health on {host}:{HEALTH} not SERVING within {READY_TIMEOUT_S:.0f} s")
            time.sleep(1)
        print(f"ok: health {host}:{HEALTH} {SERVICE_NAME} SERVING after "
              f"{READY_TIMEOUT_S - (deadline - time.monotonic()):.1f} s", flush=True)
        if probe.health("") != "SERVING":
            fail(f"health on {host}:{HEALTH} service '' (the liveness probe's) not SERVING")
    png = tiny_png()
    with VisionClient(f"{host}:{GRPC}", timeout=60) as client:
        for service in (SERVICE_NAME, ""):
            if client.health(service) != "SERVING":
                fail(f"health on {host}:{GRPC} service {service!r} not SERVING")
        print(f"ok: health {host}:{GRPC} SERVING", flush=True)
        header, rows = client.embed(png)
        if rows.ndim != 2 or rows.shape[0] != header.num_tokens or rows.shape[0] < 1:
            fail(f"Embed gave rows {rows.shape} for {header.num_tokens} tokens")
        print(f"ok: Embed {header.num_tokens} tokens -> rows {list(rows.shape)}", flush=True)
    with httpx.Client(base_url=f"http://{host}:{HTTP}", timeout=120) as http:
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        reply = http.post("/v1/chat/completions", json={
            "model": "moonshotai/Kimi-K3", "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What is in the image?"}]}]})
        if reply.status_code != 200:
            fail(f"POST /v1/chat/completions: {reply.status_code} {reply.text[:500]}")
        usage = reply.json()["usage"]
        print(f"ok: HTTP chat completion, {usage['prompt_tokens']} prompt + {usage['completion_tokens']} "
              "completion tokens", flush=True)
        metrics = httpx.get(f"http://{host}:{METRICS}/metrics", timeout=10)
        if metrics.status_code != 200 or "kimi_vision_encoder_workers_ready" not in metrics.text:
            fail(f"GET :{METRICS}/metrics: {metrics.status_code}, {len(metrics.text)} bytes")
        print(f"ok: GET :{METRICS}/metrics {len(metrics.text)} bytes", flush=True)


def logs(cpus: str) -> None:
    lines = sys.stdin.read().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            fail(f"log line {number} is not JSON: {line[:300]!r}")
    print(f"ok: all {len(lines)} log lines (stdout and stderr) are JSON objects", flush=True)
    messages = "\n".join(r["message"] for r in records)
    budget = re.search(r"^CPUs: (\d+) usable \(affinity (\d+) CPUs, cgroup quota (\S+) CPUs\)$", messages, re.M)
    pool = re.search(r"^encoder workers: (.*) \((\d+) torch/OpenCV threads each\)", messages, re.M)
    trunk = re.search(r"^trunk: cpu, (\d+) torch threads in this process$", messages, re.M)
    if budget is None or pool is None or trunk is None:
        fail("no start-up lines say the CPUs and the threads")
    usable, affinity, torch_threads = int(budget[1]), int(budget[2]), int(trunk[1])
    workers, threads = len(pool[1].split(", ")), int(pool[2])
    if float(budget[3]) != float(cpus) or usable != min(affinity, math.floor(float(cpus))) \
            or threads != max(1, usable // workers) or torch_threads != max(1, usable - workers * threads):
        fail(f"the thread defaults do not follow the {cpus}-CPU quota: {budget[0]!r}, {pool[0]!r}, {trunk[0]!r}")
    print(f"ok: {budget[0]}; {pool[0]}; {trunk[0]}", flush=True)


if __name__ == "__main__":
    {"serve": serve, "logs": logs}[sys.argv[1]](sys.argv[2])
