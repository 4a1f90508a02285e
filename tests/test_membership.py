"""Fleet membership (`--register-vllm-proxy`, `--register-sglang-bootstrap`) against the engines'
own registries, with real processes on 127.0.0.1:

- vLLM 0.33.0's EPD proxy as released (`peers.vllm_epd_proxy`) with `--dynamic-registration` and no
  instance URL on its command line: two `serve` encoders join it, a chat through it is encoded by
  both (their metrics count the images), and one that drains leaves the roster while it still
  holds a request (so before it exits); the proxy then routes every image to the other.
- SGLang 0.5.23's `EncoderBootstrapServer` (its class, from its wheel, in this process): the encoder
  registers its `--epd-port` URL once serving, stays through the bootstrap's health probes, is
  announced again after the bootstrap lost it, and unregisters at the start of its drain.
- A registry that never answers: the server serves, warns naming the URL (never the key), and
  drains within the leave's bound; one that refuses (a wrong key): one warning with its answer,
  not one per announcement.
- Bad flags: a clear startup error, exit status 2, nothing started.
"""

from __future__ import annotations

import base64
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import peers
import pytest
from black_hole import Recorder
from images import png
from serve_process import REPO_ROOT, ServeProcess, free_port, serve_command
from vllm_decoder import Decoder

from service.epd.membership import LEAVE_TIMEOUT_S, MembershipConfig
from service.server import ServerConfig, ServerThread

pytestmark = pytest.mark.timeout(300)
KEY = "membership-test-admin-key-0123456789"
IMAGES = [(REPO_ROOT / "samples" / "photo.jpg", "image/jpeg"), (REPO_ROOT / "samples" / "sticker_rgba.png",
                                                                "image/png")]


def _wait(what: str, condition: Callable[[], bool], timeout_s: float = 30.0,
          alive: ServeProcess | None = None) -> None:
    """Poll `condition` until it holds; with `alive`, that server must not exit meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if alive is not None:
            assert alive.proc.poll() is None, f"the server exited before {what}:\n{alive.log_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def _images_encoded(server: ServeProcess) -> float:
    """`kimi_vision_encoder_images_total` over the server's workers: the images its tower answered."""
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kimi_vision_encoder_images_total"))


def _queued(server: ServeProcess) -> float:
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    (line,) = [line for line in text.splitlines() if line.startswith("kimi_vision_queue_depth ")]
    return float(line.split()[1])


def _held_request(server: ServeProcess) -> socket.socket:
    """A chat completion whose body never finishes arriving: it holds an admitted place, so a drain
    waits for it (up to the body timeout) and the server stays up meanwhile."""
    sock = socket.create_connection(("127.0.0.1", server.http_port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: encoder\r\ncontent-type: application/json\r\n"
                 b"content-length: 1000\r\n\r\n{")
    _wait("the held request is admitted", lambda: _queued(server) >= 1, alive=server)
    return sock


@pytest.fixture(scope="module")
def vllm_proxy(tmp_path_factory):
    """vLLM 0.33.0's proxy, run as released with --dynamic-registration; its base URL and log."""
    script = peers.vllm_epd_proxy()
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(script), "--host", "127.0.0.1", "--port", str(port),
                             "--dynamic-registration"], stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={"PATH": "/usr/bin:/bin", "ADMIN_API_KEY": KEY})
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        _wait("vLLM's proxy answers /health", up, timeout_s=60)
        yield url, log
    finally:
        proc.terminate()
        proc.wait(30)


def _encoders(proxy: str) -> list[str]:
    return httpx.get(f"{proxy}/instances", timeout=10).json()["encode"]["live"]


def _chat(proxy: str, images: list[tuple[bytes, str]]) -> httpx.Response:
    parts = [{"type": "image_url", "image_url": {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}}
             for data, mime in images]
    return httpx.post(f"{proxy}/v1/chat/completions", timeout=120, json={
        "model": "moonshotai/Kimi-K3", "max_tokens": 4,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what?"}]}]})


def test_encoders_join_vllms_proxy_serve_its_chats_and_leave_it_when_they_drain(vllm_proxy, tmp_path):
    proxy, proxy_log = vllm_proxy
    decoder = Decoder()  # the launcher's part: the decode instance registered by hand
    try:
        reply = httpx.post(f"{proxy}/instances", headers={"X-API-Key": KEY}, timeout=10,
                           json={"role": "prefill_decode", "url": decoder.url})
        assert reply.status_code == 200, reply.text
        args = ["--devices", "cpu:1", "--http-port", "0", "--metrics-port", "0", "--ec-role", "producer",
                "--ec-export-dir", str(tmp_path / "ec"), "--cache-mb", "0", "--register-vllm-proxy", proxy]
        launched = [ServeProcess.launch(args, log_path=tmp_path / f"serve-{i}.log", env={"ADMIN_API_KEY": KEY})
                    for i in range(2)]
        with launched[0] as first, launched[1]:
            for server in launched:
                server.wait_ready()
            urls = [f"http://127.0.0.1:{server.http_port}" for server in launched]
            _wait("both encoders are on the proxy's roster", lambda: sorted(_encoders(proxy)) == sorted(urls))
            assert KEY not in first.log_text() and "joined the vLLM proxy" in first.log_text()

            before = [_images_encoded(server) for server in launched]  # the warm-up's
            reply = _chat(proxy, [(path.read_bytes(), mime) for path, mime in IMAGES])  # one to each (round robin)
            assert reply.status_code == 200, (reply.text, proxy_log.read_text()[-3000:])
            assert [_images_encoded(server) - b for server, b in zip(launched, before, strict=True)] == [1, 1]
            assert len(decoder.requests) == 1

            held = _held_request(first)
            first.proc.send_signal(signal.SIGTERM)  # SIGTERM: a drain, waiting for the held request
            _wait("the draining encoder leaves the roster", lambda: _encoders(proxy) == [urls[1]], alive=first)
            assert "left the vLLM proxy" in first.log_text()
            # Two new images (the first two are in the encoders' store now): both to the one left.
            reply = _chat(proxy, [(png(84, 56, seed=s), "image/png") for s in (5, 6)])
            assert reply.status_code == 200, (reply.text, proxy_log.read_text()[-3000:])
            assert [_images_encoded(server) - b for server, b in zip(launched, before, strict=True)] == [1, 3]
            held.close()  # the drain's last request ends (the client left): the server exits
            assert first.proc.wait(30) == 0
            assert _encoders(proxy) == [urls[1]]
        _wait("the second encoder left too", lambda: _encoders(proxy) == [], timeout_s=10)
    finally:
        decoder.shutdown()


@pytest.fixture(scope="module")
def sglang_bootstrap():
    """SGLang 0.5.23's own EncoderBootstrapServer on 127.0.0.1, probing its encoders every 0.5 s."""
    from sglang_receiver import receiver  # SGLang's wheel on sys.path (skips this module when offline)

    port = free_port()
    server = receiver.EncoderBootstrapServer("127.0.0.1", port, health_check_interval=0.5,
                                             health_check_timeout=2.0)
    url = f"http://127.0.0.1:{port}"
    _wait("SGLang's bootstrap server answers /health", lambda: _answers(f"{url}/health"), timeout_s=30)
    yield server, url
    server.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_an_encoder_registers_with_sglangs_bootstrap_server_and_unregisters_when_it_drains(sglang_bootstrap,
                                                                                          tmp_path):
    bootstrap, url = sglang_bootstrap
    args = ["--devices", "cpu:1", "--http-port", "0", "--epd-port", "0", "--metrics-port", "0",
            "--register-sglang-bootstrap", url]
    with ServeProcess.start(args, log_path=tmp_path / "serve.log") as encoder:
        mine = f"http://127.0.0.1:{encoder.epd_port}"  # where SGLang's routes are, not the OpenAI port
        _wait("the encoder is registered", lambda: bootstrap.list_urls() == [mine])
        time.sleep(2.0)  # four of the bootstrap's probes of /health: three failures would evict it
        assert bootstrap.list_urls() == [mine]
        held = _held_request(encoder)
        encoder.proc.send_signal(signal.SIGTERM)
        _wait("the draining encoder is unregistered", lambda: bootstrap.list_urls() == [], alive=encoder)
        held.close()
        assert encoder.proc.wait(30) == 0
    assert "left the SGLang bootstrap server" in encoder.log_text()


def test_an_encoder_announces_itself_again_to_a_registry_that_lost_it(sglang_bootstrap, tiny_engine):
    """A restarted language server's bootstrap starts empty: the next announcement refills it."""
    bootstrap, url = sglang_bootstrap
    membership = MembershipConfig(sglang_bootstraps=(url,), sglang_host="127.0.0.1", period_s=0.5)
    with ServerThread(ServerConfig(port=0, http_port=0, membership=membership), engine=tiny_engine) as handle:
        mine = f"http://127.0.0.1:{handle.server.http_port}"
        _wait("the encoder is registered", lambda: bootstrap.list_urls() == [mine])
        bootstrap.unregister(mine)  # as a restarted bootstrap server knows no one
        _wait("it is announced again", lambda: bootstrap.list_urls() == [mine], timeout_s=10)
        handle.drain(0)
        assert bootstrap.list_urls() == []


def test_a_registry_that_never_answers_delays_neither_serving_nor_draining(tiny_engine, caplog):
    with Recorder() as silent:  # accepts and never reads
        proxy = f"http://127.0.0.1:{silent.port}"
        membership = MembershipConfig(vllm_proxies=(proxy,), vllm_host="127.0.0.1", admin_key=KEY, period_s=0.2)
        with caplog.at_level(logging.WARNING, logger="kimi_vision.membership"):
            handle = ServerThread(ServerConfig(port=0, http_port=0, membership=membership), engine=tiny_engine)
            try:
                handle.wait_ready()
                assert httpx.get(f"http://127.0.0.1:{handle.server.http_port}/health", timeout=5).status_code == 200
                _wait("the proxy was tried", lambda: silent.peers, timeout_s=10)
                started = time.monotonic()
                handle.drain(0)
                assert time.monotonic() - started < LEAVE_TIMEOUT_S + 2
            finally:
                handle.stop()
    warnings = [record.getMessage() for record in caplog.records]
    assert any(f"could not leave the vLLM proxy {proxy}: no answer within" in line for line in warnings), warnings
    assert not any(KEY in line for line in warnings)


def test_a_refused_join_is_one_warning_naming_the_proxy_and_its_answer(vllm_proxy, tiny_engine, caplog):
    """A wrong key: vLLM's proxy answers 403 to every announcement; the warning is said once (not
    every period), with the status and the proxy's words, never the key."""
    proxy, _ = vllm_proxy
    wrong = "not-the-proxys-key-0123456789"
    membership = MembershipConfig(vllm_proxies=(proxy,), vllm_host="127.0.0.1", admin_key=wrong, period_s=0.1)
    with (caplog.at_level(logging.INFO, logger="kimi_vision.membership"),
          ServerThread(ServerConfig(port=0, http_port=0, membership=membership), engine=tiny_engine) as handle):
        def refusals() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.getMessage().startswith("could not join")]

        _wait("the refusal is logged", refusals, timeout_s=10)
        time.sleep(1.0)  # ten more announcements, all refused
        assert _encoders(proxy) == [] and handle.server.admission.serving
    (line,) = refusals()
    assert f"could not join the vLLM proxy {proxy}: HTTP 403" in line and "Invalid admin API key" in line, line
    assert not any(wrong in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("args", "env", "words"), [
    (["--register-vllm-proxy", "ftp://proxy:8000"], {"ADMIN_API_KEY": KEY},
     "--register-vllm-proxy 'ftp://proxy:8000': must be an http:// or https:// URL"),
    (["--register-sglang-bootstrap", "http://:8997"], {}, "names no host"),
    (["--register-vllm-proxy", "http://admin:secret@proxy:8000"], {"ADMIN_API_KEY": KEY},
     "credentials do not go in the URL"),
    (["--register-vllm-proxy", "http://proxy:8000"], {"ADMIN_API_KEY": ""}, "needs $ADMIN_API_KEY"),
    (["--host", "0.0.0.0", "--register-sglang-bootstrap", "http://lang:8997"], {},
     "--host '0.0.0.0' listens on every address"),
    (["--host", "::", "--register-sglang-bootstrap", "http://lang:8997", "--advertise-host", "0.0.0.0"], {},
     "--advertise-host '0.0.0.0': a wildcard address names no host"),
    (["--advertise-host", "encoder-0"], {}, "--advertise-host is the address"),
])
def test_bad_membership_flags_are_a_clear_startup_error(args, env, words):
    common = ["--devices", "cpu:1", "--http-port", "0", "--ec-role", "producer", "--ec-export-dir", "/nonexistent"]
    done = subprocess.run([*serve_command(), "serve", "--port", "0", *common, *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "ADMIN_API_KEY": "", **env})
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "secret" not in done.stderr

