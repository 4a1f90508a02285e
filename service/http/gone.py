"""A route's answer raced against its client leaving, for every route that waits on something long
(a generation, an encode, a push)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from service.errors import ClientGone

T = TypeVar("T")


async def unless_disconnected(request: Request, answer: Awaitable[T]) -> T:
    """`answer`'s result, unless the client goes away first: then `answer` is cancelled where it
    is (waiting for a slot, fetching, encoding, generating: the engine stops at its next token) and
    ClientGone (499) is raised. The request's body must have been read already."""
    work = asyncio.ensure_future(answer)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client left first (or this request itself is being cancelled)
            work.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
    if work.cancelled():
        raise ClientGone("the client closed the connection before the answer")
    return work.result()
