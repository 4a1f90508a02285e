"""End-to-end tests of the gRPC service through real servers on 127.0.0.1.

One server (the tiny random checkpoint, one CPU encoder worker) is shared by the module. Two more
servers reuse its loaded parts where a test needs a different setup: a "stopper" whose trunk head
is rewired so greedy decoding ends with <|end_of_msg|> within a token or two, and a one-slot,
no-queue server for overload and drain. Each status code of the taxonomy is produced by a real
request.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import time
import urllib.request

import grpc
import numpy as np
import pytest
import torch
from chain_model import chain_model
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from images import jpeg, png
from safetensors.torch import load_file
from serve_process import free_port

import vision
from service.engine import ChatInput, Engine, EngineConfig, ImageInput
from service.engine.scheduler import trunk_embeds
from service.engine.store import STORE_DTYPE, mm_hash
from service.rpc._proto import vision_pb2 as pb
from service.rpc.client import AsyncVisionClient, VisionClient, message, to_numpy, user
from service.rpc.convert import CHUNK_BYTES
from service.server import ServerConfig, ServerThread
from textcore.chat import render
from textcore.tokenizer import END_OF_MSG_ID, MEDIA_PAD_ID

pytestmark = pytest.mark.timeout(300)












@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ec")


@pytest.fixture(scope="module")
def metrics_port():
    return free_port()


@pytest.fixture(scope="module")
def server(tiny_checkpoint, export_dir, metrics_port):
    engine_config = EngineConfig(checkpoint=str(tiny_checkpoint), devices="cpu:1", max_images=4,
                                 ec_export_dir=str(export_dir))
    with ServerThread(ServerConfig(port=0, metrics_port=metrics_port), engine_config) as handle:
        yield handle


def _pool_rows(engine: Engine, data: bytes) -> torch.Tensor:
    """One image's rows straight from the engine's pool (the reference the RPCs must match)."""
    return engine.pool.submit(ImageInput(data), vision.plan_image(data)).result(60)



@pytest.fixture(scope="module")
def stopper(server, tiny_checkpoint):
    """A server whose trunk is rewired into a fixed chain (`chain_model`): after the generation
    prompt's last token (<|sep|>) it writes "a", then "b", then <|end_of_msg|> (shares the main
    server's pool)."""
    main = server.engine
    a, b = main.tokenizer.encode("a")[0], main.tokenizer.encode("b")[0]
    model = chain_model(tiny_checkpoint, [a, b, END_OF_MSG_ID])
    engine = Engine(EngineConfig(checkpoint=str(tiny_checkpoint)), main.tokenizer, main.pool, model)
    with ServerThread(ServerConfig(port=0), engine=engine) as handle:
        yield handle
    engine.cpu_executor.shutdown()
    engine.scheduler.close()


@pytest.fixture()
def narrow(server):
    """One slot, no queue, at most 3,000 decoded pixels per request and no export directory; an
    engine over the main server's tokenizer, pool and trunk."""
    main = server.engine
    config = dataclasses.replace(main.config, max_request_pixels=3000, ec_export_dir=None)
    engine = Engine(config, main.tokenizer, main.pool, main.model)
    handle = ServerThread(ServerConfig(port=0, max_concurrency=1, max_queue=0, drain_grace_s=60),
                          engine=engine).wait_ready()
    yield handle
    handle.stop()
    engine.cpu_executor.shutdown()
    engine.scheduler.close()


# ---------------------------------------------------------------------------------------------
# Health, reflection, metrics


def test_health_and_reflection(server, rpc_client):
    assert rpc_client.health() == "SERVING"
    assert rpc_client.health(service="") == "SERVING"
    db = ProtoReflectionDescriptorDatabase(rpc_client.channel)
    services = set(db.get_services())
    assert {"kimi.vision.v1.VisionService", "grpc.health.v1.Health"} <= services
    service = db.FindFileContainingSymbol("kimi.vision.v1.VisionService")
    assert service.name == "kimi/vision/v1/vision.proto"


def test_not_serving_until_warm(tmp_path):
    """A server whose model cannot load never becomes SERVING and refuses work with UNAVAILABLE."""
    handle = ServerThread(ServerConfig(port=0), EngineConfig(checkpoint=str(tmp_path / "missing")))
    try:
        with VisionClient(handle.target, timeout=30) as c:
            assert c.health() == "NOT_SERVING"
            with pytest.raises(Exception, match="checkpoint directory not found"):
                handle.wait_ready()
            assert c.health() == "NOT_SERVING"
            err = _code(lambda: c.count_tokens(png(28, 28)))
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "failed to load" in err.details()
    finally:
        handle.stop()


# ---------------------------------------------------------------------------------------------
# Preprocess / CountTokens


def test_preprocess_matches_in_process(rpc_client):
    data = png(225, 223, seed=1, mode="RGBA")
    ref = vision.preprocess_image(data)
    reply = rpc_client.preprocess(data)
    assert (reply.orig_width, reply.orig_height) == ref.orig_size == (225, 223)
    assert (reply.width, reply.height) == ref.size
    assert (reply.padded_width, reply.padded_height) == ref.padded_size
    assert tuple(reply.grid_thw) == ref.grid_thw
    assert reply.num_tokens == ref.num_tokens == 72  # docs/MODEL.md §5 example: 225x223 -> 72
    assert reply.prompt == ref.prompt == "<|media_begin|>image 225x223<|media_content|><|media_pad|><|media_end|>"
    assert not reply.HasField("pixel_values")

    image = rpc_client.preprocess(data, return_pixels=True)
    assert image.pixel_values.dtype == "uint8"
    np.testing.assert_array_equal(to_numpy(image.pixel_values.dtype, image.pixel_values.shape,
                                           image.pixel_values.data), ref.image)
    patches = rpc_client.preprocess(data, return_pixels=True, pixel_format="patches").pixel_values
    assert patches.dtype == "float32" and list(patches.shape) == [ref.grid_thw[1] * ref.grid_thw[2], 3, 14, 14]
    np.testing.assert_array_equal(to_numpy(patches.dtype, patches.shape, patches.data), ref.pixel_values)


def test_count_tokens_image_and_chat(rpc_client):
    data = jpeg(1920, 1080)
    assert rpc_client.count_tokens(data).num_tokens == 2691  # docs/MODEL.md §5 example
    assert rpc_client.count_tokens(data).image_tokens == [2691]
    small = png(100, 60)
    chat = [user("Compare", small, "with", png(56, 56, seed=2))]
    counted = rpc_client.count_tokens(messages=chat)
    encoded = rpc_client.encode(chat)
    assert counted.num_tokens == len(encoded.input_ids)
    assert list(counted.image_tokens) == [s.length for s in encoded.header.spans] == [12, 4]
    assert counted.text_tokens == counted.num_tokens - 16


# ---------------------------------------------------------------------------------------------
# Embed / Encode / splicing


def test_embed_equals_projector_rows_and_is_cached(server, rpc_client):
    data = png(130, 90, seed=3)
    ref = _pool_rows(server.engine, data)
    header, rows = rpc_client.embed(data)
    assert header.num_tokens == ref.shape[0] and header.hidden_size == ref.shape[1]
    assert list(header.shape) == list(ref.shape) and header.dtype == "float32"
    assert header.nbytes == rows.nbytes
    # This server has a store (--ec-export-dir): every row of a default-preprocessed image is the
    # store's, in its dtype, whether the store held it or the tower ran.
    np.testing.assert_array_equal(rows, ref.to(STORE_DTYPE).float().numpy())
    again, rows2 = rpc_client.embed(data)
    assert again.cached and not header.cached and again.content_hash == header.content_hash
    np.testing.assert_array_equal(rows2, rows)
    # The hash covers the options: another token cap is another entry.
    capped, _ = rpc_client.embed(pb.Image(data=data, options=pb.ImageOptions(max_tokens=4)))
    assert capped.content_hash != header.content_hash and capped.num_tokens <= 4
    # bfloat16 travels as its raw 16-bit words and decodes to exactly the rounded rows.
    bf16, rows_bf16 = rpc_client.embed(data, dtype="bfloat16")
    assert bf16.nbytes == rows.size * 2
    np.testing.assert_array_equal(rows_bf16, ref.to(torch.bfloat16).float().numpy())


def test_embed_streams_in_chunks_of_at_most_4_mib(server):
    data = png(1400, 1400, seed=4)  # 2500 tokens x 64 x 4 B = 640 KB: one chunk at the tiny width
    with VisionClient(server.target, timeout=120) as c:
        chunks = list(c.stub.Embed(pb.EmbedRequest(image=pb.Image(data=data))))
    assert chunks[0].HasField("header")
    assert all(len(ch.data) <= CHUNK_BYTES for ch in chunks[1:])
    assert sum(len(ch.data) for ch in chunks[1:]) == chunks[0].header.nbytes


def test_encode_expands_media_pads_and_splices_projector_rows(server, rpc_client):
    a, b, c = png(100, 60, seed=5), png(84, 84, seed=6), png(60, 100, seed=7)
    chat = [message("system", "Be brief."), user("First", a, "second", b), user("third", c, "done")]
    encoded = rpc_client.encode(chat)
    header, ids = encoded.header, encoded.input_ids
    pres = [vision.preprocess_image(x) for x in (a, b, c)]
    refs = [_pool_rows(server.engine, x) for x in (a, b, c)]
    # Exactly num_tokens media_pads per image, contiguous, in prompt order.
    assert ids.count(MEDIA_PAD_ID) == sum(p.num_tokens for p in pres)
    assert [s.length for s in header.spans] == [p.num_tokens for p in pres]
    for span in header.spans:
        assert ids[span.offset:span.offset + span.length] == [MEDIA_PAD_ID] * span.length
        assert ids[span.offset + span.length] != MEDIA_PAD_ID and ids[span.offset - 1] != MEDIA_PAD_ID
    # Collapsing each run back to one media_pad gives the template's own prompt.
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "First"}, {"type": "image"},
                                             {"type": "text", "text": "second"}, {"type": "image"}]},
                {"role": "user", "content": [{"type": "text", "text": "third"}, {"type": "image"},
                                             {"type": "text", "text": "done"}]}]
    template_ids = server.engine.tokenizer.encode_segments(render(messages, image_prompts=[p.prompt for p in pres]))
    collapsed = [t for i, t in enumerate(ids) if t != MEDIA_PAD_ID or ids[i - 1] != MEDIA_PAD_ID]
    assert collapsed == template_ids
    assert list(header.position_ids) == list(range(len(ids)))
    assert header.media_pad_id == MEDIA_PAD_ID and header.num_rows == sum(p.num_tokens for p in pres)
    # The streamed rows are the projector rows (in the store's dtype: this server has one), images
    # in span order.
    np.testing.assert_array_equal(encoded.embeddings, torch.cat(refs).to(STORE_DTYPE).float().numpy())
    # And in the trunk's input embeddings, each span holds its image's rows; text rows are the
    # token embeddings.
    engine = server.engine
    chat_input_embeddings = [engine.cache.get(s.content_hash) for s in header.spans]
    media = [ImageInput(x) for x in (a, b, c)]
    chat = ChatInput(messages)
    prompt = engine.preparer.prepare(engine.check(media, chat), media, chat).prompt
    embeds = trunk_embeds(engine.model, prompt, [e.rows for e in chat_input_embeddings])
    assert prompt.ids == ids
    text_rows = engine.model.embed_tokens(torch.tensor(ids))
    is_image = torch.tensor(ids) == MEDIA_PAD_ID
    torch.testing.assert_close(embeds[~is_image], text_rows[~is_image], rtol=0, atol=0)
    for span, ref in zip(header.spans, refs, strict=True):
        torch.testing.assert_close(embeds[span.offset:span.offset + span.length], ref.to(STORE_DTYPE).float(),
                                   rtol=0, atol=0)


def test_same_image_twice_in_one_request(rpc_client):
    data = png(42, 42, seed=11)
    encoded = rpc_client.encode([user("a", data, "b", data)])
    first, second = encoded.header.spans
    assert first.content_hash == second.content_hash and first.length == second.length == 4
    assert second.offset > first.offset + first.length  # "b" sits between them
    np.testing.assert_array_equal(encoded.embeddings[:4], encoded.embeddings[4:])


def test_encode_writes_vllm_encoder_cache(server, rpc_client, export_dir):
    data = png(70, 70, seed=8)
    encoded = rpc_client.encode([user("x", data)], export_vllm_ec=True)
    (span,) = encoded.header.spans
    # Named by the key vLLM looks the image up by: its mm_hash under the served model id.
    assert span.mm_hash == mm_hash(data, server.engine.model_id) == mm_hash(data, "moonshotai/Kimi-K3")
    path = export_dir / span.mm_hash / "encoder_cache.safetensors"
    assert span.ec_path == str(path) and path.is_file()
    written = load_file(str(path))["ec_cache"]  # as vLLM's connector reads it
    assert list(written.shape) == [span.length, encoded.header.hidden_size]
    np.testing.assert_array_equal(written.float().numpy(), encoded.embeddings)
    # A client's own item uuid is the key, verbatim (as vLLM uses it).
    tagged = rpc_client.encode([user("x", pb.Image(data=data, uuid="client-item-1"))], export_vllm_ec=True)
    assert tagged.header.spans[0].mm_hash == "client-item-1"
    assert (export_dir / "client-item-1" / "encoder_cache.safetensors").is_file()


# ---------------------------------------------------------------------------------------------
# Generate


def test_generate_streams_and_stops_at_end_of_msg(stopper):
    with VisionClient(stopper.target, timeout=120) as c:
        events = list(c.generate([user("Say something")], max_new_tokens=8))
        with_image = list(c.generate([user("Say something about", png(56, 56))], max_new_tokens=8))
    assert [e.WhichOneof("event") for e in events] == ["reasoning_delta", "reasoning_delta", "finish"]
    assert [e.reasoning_delta for e in events[:2]] == ["a", "b"]
    finish = events[-1].finish
    assert finish.reason == pb.FINISH_REASON_STOP and finish.usage.completion_tokens == 2
    assert with_image[-1].finish.reason == pb.FINISH_REASON_STOP and with_image[-1].finish.usage.image_tokens == 4
    assert with_image[:-1] == events[:-1]


def test_generate_with_image_runs_to_length(rpc_client):
    image = png(90, 90, seed=9)
    events = list(rpc_client.generate([user("What is this?", image)], max_new_tokens=5,
                                  sampling={"temperature": 0.8, "top_p": 0.9, "seed": 7}))
    finish = events[-1].finish
    assert finish.reason == pb.FINISH_REASON_LENGTH and finish.usage.completion_tokens == 5
    assert finish.usage.image_tokens == vision.count_tokens(image) == 16
    assert finish.usage.prompt_tokens == rpc_client.count_tokens(messages=[user("What is this?", image)]).num_tokens
    assert len(events) >= 2  # parsed output streamed before the finish event
    again = list(rpc_client.generate([user("What is this?", image)], max_new_tokens=5,
                                 sampling={"temperature": 0.8, "top_p": 0.9, "seed": 7}))
    assert again == events  # same seed, same reply


async def test_async_client(server):
    async with AsyncVisionClient(server.target, timeout=120) as c:
        assert await c.health() == "SERVING"
        reply = await c.preprocess(png(56, 28))
        assert reply.num_tokens == 2
        header, rows = await c.embed(png(56, 28))
        assert rows.shape == (2, header.hidden_size)
        events = [e async for e in c.generate([user("hi")], max_new_tokens=2)]
        assert events[-1].finish.usage.completion_tokens == 2


# ---------------------------------------------------------------------------------------------
# Errors: each status code from a real request


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_invalid_argument_names_the_problem(rpc_client):
    err = _code(lambda: rpc_client.preprocess(b"definitely not an image"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad image" in err.details()
    assert "Traceback" not in err.details()
    err = _code(lambda: rpc_client.embed(png(10, 10), dtype="int4"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in err.details()
    err = _code(lambda: rpc_client.encode([user("look", png(28, 28), b"GIF89a-truncated")]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages[0].content[2]" in err.details()
    err = _code(lambda: rpc_client.encode([user(*[png(28, 28, seed=i) for i in range(5)])]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "too many images" in err.details()
    err = _code(lambda: rpc_client.encode([pb.ChatMessage(role="robot", content=[pb.ContentPart(text="hi")])]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in err.details()
    err = _code(lambda: next(rpc_client.generate([user("hi")], tools="{not json", max_new_tokens=1)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools_json" in err.details()


def test_message_size_limit(server):
    with VisionClient(server.target, timeout=60, max_send_bytes=128 << 20) as c:
        err = _code(lambda: c.preprocess(b"\0" * (65 << 20)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_video_is_unimplemented(rpc_client):
    mp4 = b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00isomiso2avc1mp41" + b"\x00" * 64
    err = _code(lambda: rpc_client.preprocess(mp4))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED and "video" in err.details()
    err = _code(lambda: rpc_client.embed(pb.Image(data=png(28, 28), mime_type="video/mp4")))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED


def test_export_without_directory_is_failed_precondition(narrow):
    with VisionClient(narrow.target, timeout=60) as c:
        err = _code(lambda: c.encode([user("x", png(28, 28))], export_vllm_ec=True))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "--ec-export-dir" in err.details()


def test_request_pixel_cap(narrow):
    with VisionClient(narrow.target, timeout=60) as c:
        assert len(c.encode([user("two", png(30, 50), png(50, 30))]).header.spans) == 2  # 3,000 pixels
        err = _code(lambda: c.encode([user("two", png(30, 50), png(50, 31))]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "3050 pixels; the limit is 3000" in err.details()


def _trunk_idle_within(engine, seconds: float) -> bool:
    """True when the trunk's scheduler holds no generation within `seconds` (none is still decoding)."""
    deadline = time.monotonic() + seconds
    while not engine.scheduler.idle:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_deadline_exceeded_stops_generation(server, rpc_client):
    start = time.monotonic()
    err = _code(lambda: list(rpc_client.generate([user("Tell me a long story")], max_new_tokens=4000, timeout=1.5)))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 30
    # 4000 tokens take minutes here; the trunk must be free again within seconds.
    assert _trunk_idle_within(server.engine, 20)
    # The server records the RPC when its handler unwinds, which may be just after the client gave up.
    sample = server.server.metrics.registry.get_sample_value
    labels = {"grpc_type": "server_stream", "grpc_service": "kimi.vision.v1.VisionService", "grpc_method": "Generate",
              "grpc_code": "DeadlineExceeded"}
    deadline = time.monotonic() + 10
    while not sample("grpc_server_handled_total", labels) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sample("grpc_server_handled_total", labels) >= 1


def test_overload_cancel_and_drain(narrow, server):
    """One slot and no queue: a second request is RESOURCE_EXHAUSTED; cancelling the first frees the
    slot; during a drain new requests are UNAVAILABLE, health says NOT_SERVING, and the in-flight
    request still finishes."""
    with VisionClient(narrow.target, timeout=120) as c:
        long_call = c.generate([user("Tell me a long story")], max_new_tokens=4000)
        first = next(long_call)  # the slot is now held
        assert first.WhichOneof("event") != "finish"
        err = _code(lambda: c.count_tokens(png(28, 28)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "capacity" in err.details()
        long_call.cancel()
        assert _trunk_idle_within(narrow.engine, 20)
        deadline = time.monotonic() + 10
        while narrow.server.admission.admitted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.count_tokens(png(28, 28)).num_tokens == 1  # the cancelled call gave its slot back

        in_flight = c.generate([user("Tell me a long story")], max_new_tokens=40)
        next(in_flight)
        drained = narrow.submit(narrow.server.drain())
        deadline = time.monotonic() + 10
        while not narrow.server.draining and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.health() == "NOT_SERVING"
        err = _code(lambda: c.count_tokens(png(28, 28)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.details()
        rest = list(in_flight)
        assert rest[-1].finish.reason == pb.FINISH_REASON_LENGTH
        drained.result(timeout=60)


def test_metrics_endpoint(server, rpc_client, metrics_port):
    rpc_client.preprocess(png(28, 28))
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    rpc = 'grpc_method="Preprocess",grpc_service="kimi.vision.v1.VisionService",grpc_type="unary"'
    assert f'grpc_server_handled_total{{grpc_code="OK",{rpc}}}' in text
    assert f"grpc_server_handling_seconds_bucket{{{rpc}," in text and "kimi_vision_queue_depth" in text
    assert 'kimi_vision_tokens_total{kind="image"}' in text
    assert "kimi_vision_encoder_workers_ready 1.0" in text


def test_concurrent_requests_share_the_pool(rpc_client):
    images = [png(56 + 28 * i, 56, seed=20 + i) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda d: rpc_client.embed(d)[1].shape[0], images))
    assert results == [vision.count_tokens(d) for d in images]



def test_sample_client_script(server):
    import subprocess
    import sys

    from conftest import REPO_ROOT

    out = subprocess.run(
        [sys.executable, str(REPO_ROOT / "samples" / "client.py"), "--target", server.target, "--max-new-tokens", "3",
         str(REPO_ROOT / "samples" / "photo.jpg"), str(REPO_ROOT / "samples" / "sticker_rgba.png")],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env={"PYTHONPATH": str(REPO_ROOT), "PATH": ""},
    )
    assert out.returncode == 0, out.stderr
    assert "photo.jpg: 640x480 -> 644x504, 414 tokens, embedding (414, 64) (bfloat16)" in out.stdout
    assert "[3 tokens generated]" in out.stdout


def test_worker_death_is_unavailable_and_health_recovers(server, rpc_client):
    """kill -9 of the encoder worker mid-request: that request is UNAVAILABLE (retryable), the pool
    restarts the worker, health is SERVING again and the same request then succeeds."""
    import os
    import signal

    pool = server.engine.pool
    data = png(1000, 1000, seed=99)  # ~5k patches: the tiny tower needs a while on them
    with concurrent.futures.ThreadPoolExecutor(1) as runner:
        call = runner.submit(rpc_client.embed, data)
        deadline = time.monotonic() + 60
        while not pool.health()["workers"][0]["inflight"] and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(pool.health()["workers"][0]["pid"], signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "died" in info.value.details()
    header, rows = rpc_client.embed(data)
    assert rows.shape == (vision.count_tokens(data), header.hidden_size)
    deadline = time.monotonic() + 30
    while rpc_client.health() != "SERVING" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rpc_client.health() == "SERVING"


def test_demo_command(tiny_checkpoint, tmp_path):
    """The README's main job (`./run.sh demo`: set-up, then `kimi-vision demo`) on the embedded
    default, end to end. It runs on the venv running these tests, which is set up already (CI made
    it with `./run.sh test`), so the command must install nothing: its set-up is idempotent."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import REPO_ROOT

    from service.checkpoints.default import generator_key

    readme = (REPO_ROOT / "README.md").read_text()
    command = re.search(r"Main job.*?```bash\n(.*?)\n```", readme, re.S).group(1).strip()
    assert command == "./run.sh demo"
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "kimi-vision").exists(), "the kimi-vision console script is not installed (pip install -e .)"
    (tmp_path / generator_key()).symlink_to(tiny_checkpoint)  # the default is this same tiny checkpoint
    env = {**os.environ, "KIMI_VISION_CACHE": str(tmp_path), "KIMI_VISION_VENV": sys.prefix}
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "installing" not in out.stderr, out.stderr  # set up already: nothing to install
    assert "tiny RANDOM checkpoint" in out.stdout and "health: SERVING" in out.stdout
    assert re.search(r"photo.jpg +640x480 +414 ", out.stdout)
    assert "Encode (" in out.stdout and "[finish: max_new_tokens" in out.stdout
