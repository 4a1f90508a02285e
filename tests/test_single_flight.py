"""Single flight: concurrent requests for one image (one content key) share one encode, on a real
engine with one CPU encoder worker and no embedding cache (so nothing but the flight can share)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from images import png

from service.engine import MediaInput

pytestmark = pytest.mark.timeout(300)


def _encoded(engine) -> int:
    """Images the pool's workers have answered so far."""
    return sum(worker["answered"] for worker in engine.pool.health()["workers"])


def test_concurrent_requests_for_one_image_share_one_encode(tiny_engine):
    data = png(640, 480, seed=101)
    before = _encoded(tiny_engine)

    async def run():
        return await asyncio.gather(*(tiny_engine.embed([MediaInput(data)]) for _ in range(8)))

    results = asyncio.run(run())
    assert _encoded(tiny_engine) - before == 1
    first = results[0][0].rows
    assert all(torch.equal(result[0].rows, first) for result in results)
    assert not tiny_engine._flights  # nothing left under way

    asyncio.run(tiny_engine.embed([MediaInput(data)]))  # after them, no cache here: a new encode
    assert _encoded(tiny_engine) - before == 2


def test_a_cancelled_first_caller_does_not_fail_the_others(tiny_engine):
    data = png(1920, 1080, seed=102)
    before = _encoded(tiny_engine)

    async def run():
        leader = asyncio.ensure_future(tiny_engine.embed([MediaInput(data)]))
        while not tiny_engine._flights:  # the leader's encode is under way
            await asyncio.sleep(0.001)
        (flight,) = tiny_engine._flights.values()
        follower = asyncio.ensure_future(tiny_engine.embed([MediaInput(data)]))
        while flight.waiters < 2:  # the follower has joined it
            await asyncio.sleep(0)
        assert not flight.task.done()
        leader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leader
        return await follower

    (embedding,) = asyncio.run(run())
    (alone,) = asyncio.run(tiny_engine.embed([MediaInput(data)]))
    assert torch.equal(embedding.rows, alone.rows)
    assert _encoded(tiny_engine) - before == 2  # the shared encode, then the one alone


def test_a_flight_no_one_waits_for_is_withdrawn(tiny_engine):
    """Every caller gone: the encode is cancelled (withdrawn from the pool if still queued), and
    the next request starts its own."""
    data = png(320, 240, seed=103)

    async def run():
        callers = [asyncio.ensure_future(tiny_engine.embed([MediaInput(data)])) for _ in range(3)]
        await asyncio.sleep(0.01)
        for caller in callers:
            caller.cancel()
        await asyncio.gather(*callers, return_exceptions=True)
        await asyncio.sleep(0.05)
        assert not tiny_engine._flights
        return await tiny_engine.embed([MediaInput(data)])

    (embedding,) = asyncio.run(run())
    assert embedding.rows.shape[0] == embedding.num_tokens


def test_a_shared_encode_that_fails_names_each_callers_own_item(tiny_engine):
    from test_preprocess_errors import png_header_only  # a header that plans; its pixels are missing

    data = png_header_only(300, 200)

    async def run():
        return await asyncio.gather(
            tiny_engine.embed([MediaInput(data, where="messages[0].content[1]")]),
            tiny_engine.embed([MediaInput(png(56, 56), where="a"), MediaInput(data, where="messages[2].content[0]")]),
            return_exceptions=True)

    first, second = asyncio.run(run())
    assert str(first).startswith("messages[0].content[1]: ") and "truncated or corrupt" in str(first)
    assert str(second).startswith("messages[2].content[0]: ") and "truncated or corrupt" in str(second)
