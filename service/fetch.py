"""Fetching the bytes of a request's media (`service.media.MediaRef`), by the rules of the face that asks.

- `data:` URLs (base64) are always read: the bytes travel in the request.
- Local files (a path or a `file://` URL) only where the face names a base directory (a batch
  job reads its own inputs; a server never opens a path a caller names).
- `http(s)://` only with `allow_remote` (`--allow-remote-images`). A request's images are fetched
  concurrently (at most `concurrency` remote fetches at once per fetcher, whichever requests they
  belong to), each whole transfer, redirects included, and all of a request's together within
  `timeout_s` (`--media-fetch-timeout`), each under the per-image byte limit (refused while it
  streams in), following at most `max_redirects` redirects.

The SSRF guard, on every hop: a URL must stay http(s); with `allowed_domains`
(`--allowed-media-domains`, vLLM's flag) only those hosts are fetched at all, and a listed host is
trusted to be anywhere; any other host is resolved and refused unless every address it has is
public (loopback, private, link-local, multicast, reserved, unspecified, shared and the IPv6 forms
that carry an IPv4 address are refused: IPv4-mapped, 6to4, NAT64). The address checked is the one
connected to (`_CheckedBackend`: the name is resolved once, at connect time, so there is no
window for DNS rebinding), while the request and TLS still name the host.

A failure is that image's error, with a kind: a URL that cannot work (refused by the guard,
redirected out of http(s), an upstream 4xx) is bad input, a body over the limit too large, a
network problem of a host the rules allow (timeout, refused connection, an upstream 5xx, 408 or
429) unavailable (a batch job retries it), so one bad image never fails a whole job. A refused
host is refused before any connection: its answer says nothing about what listens there.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import ipaddress
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import httpcore
import httpx

from service.errors import BadRequest, TooLarge, Unavailable
from service.media import MediaRef

# httpx logs every request's URL at INFO: a caller's URL (a signed query, a token) stays out of the log.
logging.getLogger("httpx").setLevel(logging.WARNING)

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_REDIRECTS = 3
DEFAULT_CONCURRENCY = 16
_REDIRECTS = (301, 302, 303, 307, 308)
# An upstream's "later": a network problem of an allowed host, as vLLM counts them.
_TRANSIENT_STATUSES = (408, 429)
# Public-looking IPv6 ranges that carry an IPv4 destination (6to4, NAT64), and the shared
# address space of carrier-grade NAT (not `is_private`, not public either).
_REFUSED_NETWORKS = (ipaddress.ip_network("2002::/16"), ipaddress.ip_network("64:ff9b::/96"),
                     ipaddress.ip_network("100.64.0.0/10"))


def refused_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a fetch may not connect to `address` (an IPv4-mapped IPv6 one is judged as its IPv4)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return (address.is_loopback or address.is_private or address.is_link_local or address.is_multicast
            or address.is_reserved or address.is_unspecified or not address.is_global
            or (isinstance(address, ipaddress.IPv6Address) and address.is_site_local)
            or any(address in network for network in _REFUSED_NETWORKS))


class _Refused(Exception):
    """A hop the rules do not fetch (raised inside the HTTP client, reported as bad input)."""


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, but each connection goes to an address that was resolved and
    checked here, in the same step: a name cannot resolve to a public address for the check and a
    private one for the connection."""

    def __init__(self, trusted_hosts: frozenset[str]) -> None:
        self._trusted = trusted_hosts
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {exc}") from None
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)]
        if not addresses:
            raise httpcore.ConnectError(f"cannot resolve {host!r}")
        if host.lower() not in self._trusted and any(refused_address(a) for a in addresses):
            raise _Refused(f"the host {host!r} is not a public address; only public hosts are fetched (or those "
                           "listed in --allowed-media-domains)")
        return await self._inner.connect_tcp(str(addresses[0]), port, timeout=timeout, local_address=local_address,
                                             socket_options=socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


@contextlib.contextmanager
def _as_httpx() -> Iterator[None]:
    """httpcore's failures as httpx's (what httpx's own transport does)."""
    try:
        yield
    except httpcore.TimeoutException as exc:
        raise httpx.TimeoutException(str(exc)) from None
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol) as exc:
        raise httpx.TransportError(str(exc) or type(exc).__name__) from None


class _Body(httpx.AsyncByteStream):
    def __init__(self, stream: Any) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx():
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        await self._stream.aclose()


class _CheckedTransport(httpx.AsyncBaseTransport):
    """An httpx transport over an httpcore pool whose connections `_CheckedBackend` makes."""

    def __init__(self, ssl_context: ssl.SSLContext, trusted_hosts: frozenset[str]) -> None:
        self._pool = httpcore.AsyncConnectionPool(ssl_context=ssl_context,
                                                  network_backend=_CheckedBackend(trusted_hosts))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host, port=request.url.port,
                           target=request.url.raw_path)
        with _as_httpx():
            reply = await self._pool.handle_async_request(httpcore.Request(
                method=request.method, url=url, headers=request.headers.raw, content=request.stream,
                extensions=request.extensions))
        return httpx.Response(status_code=reply.status, headers=reply.headers, stream=_Body(reply.stream),
                              extensions=reply.extensions)

    async def aclose(self) -> None:
        await self._pool.aclose()


class MediaFetcher:
    """The bytes of media items, by one face's rules. One per server (or batch job): its bound on
    remote fetches is shared by every request that uses it."""

    def __init__(self, max_bytes: int, *, allow_remote: bool = False, base_dir: Path | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_redirects: int = DEFAULT_MAX_REDIRECTS,
                 allowed_domains: Sequence[str] | None = None, concurrency: int = DEFAULT_CONCURRENCY) -> None:
        if timeout_s <= 0 or max_redirects < 0 or concurrency < 1:
            raise ValueError("timeout_s must be > 0, max_redirects >= 0 and concurrency >= 1")
        self.max_bytes = max_bytes  # per image
        self.allow_remote = allow_remote
        self.base_dir = base_dir  # local files are read (relative to it) only when set
        self.timeout_s = timeout_s
        self.max_redirects = max_redirects
        self.allowed_domains = frozenset(d.lower() for d in allowed_domains) if allowed_domains else None
        self.concurrency = concurrency
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._ssl: ssl.SSLContext | None = None

    async def fetch_all(self, parts: Sequence[MediaRef]) -> list[bytes]:
        """Every part's bytes, in order, the remote ones fetched concurrently; all of them within
        `timeout_s`. The first failure (in the parts' order) is raised, the other fetches stopped."""
        remote = [part for part in parts if _scheme(part.url) in ("http", "https")]
        if not remote:
            return [await self.fetch(part) for part in parts]
        client = self._client()
        tasks = [asyncio.ensure_future(self._bytes_of(part, client)) for part in parts]
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except TimeoutError:
            raise Unavailable(f"the request's remote images ({len(remote)}) were not all fetched within "
                              f"{self.timeout_s:g} s") from None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.aclose()
        failed = next((task.exception() for task in tasks if not task.cancelled() and task.exception()), None)
        if failed is not None:
            raise failed
        return [task.result() for task in tasks]

    async def fetch(self, part: MediaRef) -> bytes:
        """One part's bytes."""
        if _scheme(part.url) not in ("http", "https"):
            return await self._bytes_of(part, None)
        async with self._client() as client:
            return await self._bytes_of(part, client)

    async def _bytes_of(self, part: MediaRef, client: httpx.AsyncClient | None) -> bytes:
        url = part.url
        if url.startswith("data:"):
            return self._data_url(part)
        scheme = _scheme(url)
        if scheme in ("http", "https"):
            return await self._remote(part, client)
        if scheme in ("", "file") or Path(url).is_absolute():
            return self._local(part)
        raise BadRequest(f"{part.where}: image URL scheme {scheme!r} is not supported (data:, http(s):// or a path)")

    def _remote_slots(self) -> asyncio.Semaphore:
        """The bound on remote fetches, of the running event loop (a Ray actor runs one per batch)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(self.concurrency))
        return self._slots[1]

    def _client(self) -> httpx.AsyncClient:
        if self._ssl is None:  # once: loading the CA bundle takes a while
            self._ssl = httpx.create_ssl_context(trust_env=False)
        trusted = self.allowed_domains or frozenset()
        # identity: the bytes counted against the limit are the bytes held (no decompression bomb)
        return httpx.AsyncClient(transport=_CheckedTransport(self._ssl, trusted), timeout=self.timeout_s,
                                 follow_redirects=False, trust_env=False, headers={"accept-encoding": "identity"})

    def _data_url(self, part: MediaRef) -> bytes:
        header, sep, payload = part.url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise BadRequest(f"{part.where}: a data: URL must be base64 (data:image/...;base64,...)")
        if len(payload) > 4 * (self.max_bytes // 3 + 1):
            raise TooLarge(f"{part.where}: the data: URL holds more than the per-image limit of {self.max_bytes:,} "
                           "bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise BadRequest(f"{part.where}: data: URL is not valid base64: {e}") from None

    def _local(self, part: MediaRef) -> bytes:
        if self.base_dir is None:
            raise BadRequest(f"{part.where}: this server does not read local files; send a data: URL"
                             + (" or an http(s) URL" if self.allow_remote else ""))
        parsed = urlparse(part.url)
        raw = unquote(parsed.path) if parsed.scheme == "file" else part.url
        path = Path(raw) if Path(raw).is_absolute() else self.base_dir / raw
        try:
            size = path.stat().st_size
            if size > self.max_bytes:
                raise TooLarge(f"{part.where}: {path} is {size:,} bytes, over the per-image limit of "
                               f"{self.max_bytes:,} bytes")
            return path.read_bytes()
        except FileNotFoundError:
            raise BadRequest(f"{part.where}: {path}: no such file") from None
        except IsADirectoryError:
            raise BadRequest(f"{part.where}: {path}: is a directory, not an image") from None
        except OSError as e:  # permissions, NFS hiccups: worth another try
            raise Unavailable(f"{part.where}: {path}: cannot read: {e.strerror or e}") from None

    def _check_hop(self, where: str, url: httpx.URL) -> None:
        if url.scheme not in ("http", "https"):
            raise BadRequest(f"{where}: redirected to a {url.scheme}: URL; only http(s) image URLs are fetched")
        if self.allowed_domains is not None and url.host.lower() not in self.allowed_domains:
            raise BadRequest(f"{where}: the URL must be from one of the allowed domains "
                             f"{sorted(self.allowed_domains)}; this one is from {url.host!r}")

    async def _remote(self, part: MediaRef, client: httpx.AsyncClient) -> bytes:
        where = f"{part.where}: {part.url}"
        if not self.allow_remote:
            raise BadRequest(f"{part.where}: remote image URLs are not fetched unless the server or job runs with "
                             "--allow-remote-images; send the image as a data: URL")
        try:
            url = httpx.URL(part.url)
        except (httpx.InvalidURL, ValueError) as e:
            raise BadRequest(f"{where}: not a valid URL: {e}") from None
        async with self._remote_slots():
            try:
                async with asyncio.timeout(self.timeout_s):
                    return await self._transfer(where, url, client)
            except TimeoutError:
                raise Unavailable(f"{where}: not fetched within {self.timeout_s:g} s") from None
            except _Refused as e:
                raise BadRequest(f"{where}: {e}") from None
            except httpx.TimeoutException:
                raise Unavailable(f"{where}: no answer within {self.timeout_s:g} s") from None
            except httpx.HTTPError as e:  # refused, reset, DNS: the network, not the request
                raise Unavailable(f"{where}: {type(e).__name__}: {e}") from None

    async def _transfer(self, where: str, url: httpx.URL, client: httpx.AsyncClient) -> bytes:
        for _ in range(self.max_redirects + 1):
            self._check_hop(where, url)
            async with client.stream("GET", url) as reply:
                if reply.status_code in _REDIRECTS:
                    location = reply.headers.get("location")
                    if not location:
                        raise BadRequest(f"{where}: HTTP {reply.status_code} without a Location")
                    try:
                        url = url.join(location)
                    except (httpx.InvalidURL, ValueError) as e:
                        raise BadRequest(f"{where}: redirected to an invalid URL: {e}") from None
                    continue
                return await self._body(where, reply)
        raise BadRequest(f"{where}: more than {self.max_redirects} redirects")

    async def _body(self, where: str, reply: httpx.Response) -> bytes:
        status = reply.status_code
        if status >= 500 or status in _TRANSIENT_STATUSES:
            raise Unavailable(f"{where}: HTTP {status}")
        if status != 200:
            raise BadRequest(f"{where}: HTTP {status}")
        declared = reply.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_bytes:
            raise TooLarge(f"{where} is {int(declared):,} bytes, over the per-image limit of {self.max_bytes:,} bytes")
        body = bytearray()
        async for chunk in reply.aiter_raw():
            body += chunk
            if len(body) > self.max_bytes:
                raise TooLarge(f"{where} is over the per-image limit of {self.max_bytes:,} bytes")
        return bytes(body)


def _scheme(url: str) -> str:
    return "data" if url.startswith("data:") else urlparse(url).scheme.lower()
