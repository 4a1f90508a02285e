"""Fetching the bytes of an `image_url` part, by the rules of the face that asks.

- `data:` URLs (base64) are always read: the bytes travel in the request.
- Local files (a path or a `file://` URL) only where the face names a base directory (a batch
  job reads its own inputs; a server never opens a path a caller names).
- `http(s)://` only with `allow_remote` (`--allow-remote-images`), with a connect/read timeout, a
  byte limit (the per-image limit: an image over it is refused while it streams in) and a bounded
  number of redirects.

A failure is that image's error, with a kind: a URL that cannot work is bad input, a body over the
limit too large, a network problem (timeout, refused connection, 5xx) unavailable (a batch job
retries it), so one bad image never fails a whole job.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx

from service.errors import BadRequest, TooLarge, Unavailable
from service.openai.request import ImagePart


@dataclass(frozen=True)
class ImageFetcher:
    max_bytes: int  # per image
    allow_remote: bool = False
    base_dir: Path | None = None  # local files are read (relative to it) only when set
    timeout_s: float = 10.0
    max_redirects: int = 3

    async def fetch(self, part: ImagePart) -> bytes:
        url = part.url
        if url.startswith("data:"):
            return self._data_url(part)
        scheme = urlparse(url).scheme.lower()
        if scheme in ("http", "https"):
            return await self._remote(part)
        if scheme in ("", "file") or Path(url).is_absolute():
            return self._local(part)
        raise BadRequest(f"{part.where}: image URL scheme {scheme!r} is not supported (data:, http(s):// or a path)")

    def _data_url(self, part: ImagePart) -> bytes:
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

    def _local(self, part: ImagePart) -> bytes:
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

    async def _remote(self, part: ImagePart) -> bytes:
        if not self.allow_remote:
            raise BadRequest(f"{part.where}: remote image URLs are not fetched unless the server or job runs with "
                             "--allow-remote-images; send the image as a data: URL")
        limits = httpx.Timeout(self.timeout_s)
        try:
            async with httpx.AsyncClient(timeout=limits, follow_redirects=True, max_redirects=self.max_redirects,
                                         trust_env=False) as client, client.stream("GET", part.url) as reply:
                if reply.status_code >= 500:
                    raise Unavailable(f"{part.where}: {part.url}: HTTP {reply.status_code}")
                if reply.status_code != 200:
                    raise BadRequest(f"{part.where}: {part.url}: HTTP {reply.status_code}")
                declared = reply.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > self.max_bytes:
                    raise TooLarge(f"{part.where}: {part.url} is {int(declared):,} bytes, over the per-image limit "
                                   f"of {self.max_bytes:,} bytes")
                body = bytearray()
                async for chunk in reply.aiter_bytes():
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise TooLarge(f"{part.where}: {part.url} is over the per-image limit of "
                                       f"{self.max_bytes:,} bytes")
                return bytes(body)
        except httpx.TooManyRedirects:
            raise BadRequest(f"{part.where}: {part.url}: more than {self.max_redirects} redirects") from None
        except httpx.TimeoutException:
            raise Unavailable(f"{part.where}: {part.url}: no answer within {self.timeout_s:g} s") from None
        except httpx.HTTPError as e:  # refused, reset, DNS: the network, not the request
            raise Unavailable(f"{part.where}: {part.url}: {type(e).__name__}: {e}") from None
