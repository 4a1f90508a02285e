"""Each process reads an image's header once: the server to plan it (`Engine.embed`), the worker,
sent that plan with the bytes, to decode the pixels (`ImageEncoder.launch` never plans again).
A shared-memory payload is read in place, never copied whole. An image a worker refuses gets the
same `where` prefix as one refused from its header, and is counted once.

Header reads are counted by patching `vision.decode.open_header` in every module that imported it
by name. Workers fork from a forkserver, out of the patch's reach, so the worker's own loop
(`service.engine.worker.serve`) runs here, over real queues."""

from __future__ import annotations

import collections
import hashlib
import sys
import threading
import tracemalloc

import pytest
import torch
import torch.multiprocessing as tmp
from images import png

import vision.decode
from service.engine import Engine, EngineConfig, ImageInput
from service.engine.worker import ImageEncoder, pack_bytes, serve, unpack_bytes, unpack_rows
from tests.conftest import REPO_ROOT
from vision import DEFAULT_LIMITS, DEFAULT_OPTIONS, ImageDecodeError, ImageOptions, plan_image, preprocess_image

pytestmark = pytest.mark.usefixtures("torch_one_thread")




def key(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()




@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    loaded = Engine.load(EngineConfig(checkpoint=str(tiny_checkpoint), devices="cpu:1", components="vision",
                                      keep_freed_bytes=0))
    yield loaded
    loaded.close()


@pytest.fixture
def header_reads(monkeypatch) -> collections.Counter:
    """open_header calls in this process from now on, by the bytes they read."""
    reads: collections.Counter = collections.Counter()
    original = vision.decode.open_header

    def counted(data, *args, **kwargs):
        reads[key(data)] += 1
        return original(data, *args, **kwargs)

    importers = [name for name, module in list(sys.modules.items()) if vars(module).get("open_header") is original]
    assert {"vision.decode", "vision.preprocess"} <= set(importers)
    for name in importers:
        monkeypatch.setattr(sys.modules[name], "open_header", counted)
    return reads


async def test_embed_reads_each_header_once_in_the_server(engine, header_reads):
    images = [png(56, 84, seed=1), png(300, 200, seed=2), png(28, 28, seed=3)]
    answered = engine.pool.health()["workers"][0]["answered"]
    first = await engine.embed([ImageInput(data) for data in images])
    assert header_reads == {key(data): 1 for data in images}
    assert engine.pool.health()["workers"][0]["answered"] == answered + len(images)
    # Cache hits: each header is read once more (for its plan and the request's caps), and no
    # worker is asked.
    again = await engine.embed([ImageInput(data) for data in images])
    assert header_reads == {key(data): 2 for data in images}
    assert all(e.cached for e in again) and engine.pool.health()["workers"][0]["answered"] == answered + len(images)
    assert all(torch.equal(a.rows, b.rows) for a, b in zip(first, again, strict=True))


def test_the_worker_reads_each_header_once_and_never_plans(tiny_encoder, header_reads):
    """The worker's own loop over real queues, sent what the pool sends: small bytes pickled,
    large ones (over `inline_bytes`) as a shared-memory tensor read in place."""
    encoder = tiny_encoder
    inline_bytes = 4096
    images = [(png(56, 84, seed=1), DEFAULT_OPTIONS), (png(300, 200, seed=2), ImageOptions(max_tokens=64)),
              ((REPO_ROOT / "samples" / "sticker_rgba.png").read_bytes(), DEFAULT_OPTIONS)]
    broken = png(90, 90, seed=4)
    broken = broken[: len(broken) * 3 // 5]  # the header reads, the pixels do not decode
    images.append((broken, DEFAULT_OPTIONS))
    assert min(len(d) for d, _ in images) <= inline_bytes < max(len(d) for d, _ in images)
    plans = [plan_image(data, options) for data, options in images]  # the parent's reads
    expected = [encoder.encode([preprocess_image(data, options)])[0] for data, options in images[:-1]]

    ctx = tmp.get_context("forkserver")
    requests, (receive, send) = ctx.Queue(), ctx.Pipe(duplex=False)
    for patchify in ("host", "device"):
        header_reads.clear()
        worker = ImageEncoder(encoder, DEFAULT_LIMITS, patchify)
        loop = threading.Thread(target=serve, args=(worker, inline_bytes, requests, send))
        loop.start()
        for i, ((data, options), plan) in enumerate(zip(images, plans, strict=True)):
            requests.put((i, pack_bytes(data, inline_bytes), options, plan))
        requests.put(None)
        answers = [receive.recv() for _ in images]
        loop.join(60)
        assert not loop.is_alive()
        for (kind, i, value), want in zip(answers, expected, strict=False):
            assert kind == "ok" and torch.equal(unpack_rows(value), want), (patchify, i)
        kind, _, error = answers[-1]
        assert kind == "bad_image" and isinstance(error, ImageDecodeError)
        assert header_reads == {key(data): 1 for data, _ in images}, patchify
    requests.close()


def test_a_shared_memory_payload_is_never_copied_whole(tiny_encoder):
    """Python-heap high-water mark (tracemalloc) of a worker encoding a 3.9 MB PNG from shared
    memory, buffers warm: a copy of the payload (`bytes(view)`, `io.BytesIO(view)`) would be over
    3.9 MB; measured 0.6 MB (host patchify) and 0.14 MB (device)."""
    data = png(1300, 1000, seed=5)
    options = ImageOptions(max_tokens=64)
    plan = plan_image(data, options)
    encoder = tiny_encoder
    for patchify in ("host", "device"):
        worker = ImageEncoder(encoder, DEFAULT_LIMITS, patchify)
        view = unpack_bytes(pack_bytes(data, 0))
        assert isinstance(view, memoryview)
        want = worker.encode(view, options, plan)  # warms the reused buffers
        tracemalloc.start()
        try:
            rows = worker.encode(view, options, plan)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert torch.equal(rows, want)
        assert peak < len(data) // 2, (patchify, peak, len(data))


async def test_an_image_a_worker_refuses_is_named_and_counted_once(engine):
    """Pixels the header did not show are found by the worker: its error reaches the caller as a
    header error does, prefixed with the image's place in the chat, same class, counted once."""
    truncated = png(120, 90, seed=6)
    truncated = truncated[: len(truncated) // 2]
    assert plan_image(truncated).num_tokens > 0  # the header is sound
    with pytest.raises(ImageDecodeError) as here:
        preprocess_image(truncated)
    not_an_image = b"this is not an image" * 4
    with pytest.raises(ImageDecodeError) as header:
        preprocess_image(not_an_image)

    def refused() -> float:
        value = engine.metrics.registry.get_sample_value("kimi_vision_images_refused_total", {"reason": "bad_input"})
        return value or 0.0

    for data, error in ((truncated, here.value), (not_an_image, header.value)):
        before = refused()
        with pytest.raises(ImageDecodeError) as info:
            await engine.embed([ImageInput(data, where="messages[0].content[1]")])
        assert type(info.value) is type(error)
        assert str(info.value) == f"messages[0].content[1]: {error}"
        assert refused() == before + 1
