"""Fleet membership: this encoder joins the engines' rosters on its own, and leaves them first
when it drains, so scaling the encoders out or in needs no language server or proxy reconfigured.

- vLLM's EPD proxy (0.33.0's `disagg_epd_proxy.py --dynamic-registration`): `POST /instances`
  `{"role": "encode", "url"}` with `X-API-Key: $ADMIN_API_KEY`, re-announced every
  `ANNOUNCE_PERIOD_S` (as vLLM's own instances do on its main branch), so a restarted proxy
  refills; `DELETE /instances?url=` to leave. The URL is the HTTP face's: the proxy calls
  `/v1/chat/completions` and probes `/health` there.
- SGLang's encoder bootstrap server (the language side's `--encoder-bootstrap-port`):
  `POST /register_encoder_url {"url"}`, `DELETE /unregister_encoder_url {"url"}`, the URL being
  where SGLang's encoder routes are (`--epd-port`, else the HTTP port); it probes `/health` too.
  Re-announced on the same period: registering twice is a no-op there.

Announcing happens only while health is SERVING (SGLang's register would revive an encoder its
probes just evicted). A registry that is down or refuses gets a warning naming it and what it
said (rate-limited, never the key) and is tried again the next period; nothing here stops the
server from serving or draining: every request has a total bound, the leave `LEAVE_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("kimi_vision.membership")

ADMIN_KEY_ENV = "ADMIN_API_KEY"  # the name vLLM's proxy and its launcher read the key from
ANNOUNCE_PERIOD_S = 30.0
REQUEST_TIMEOUT_S = 5.0  # one join, all of it (connect, send, the reply's first KiB)
LEAVE_TIMEOUT_S = 3.0  # every leave at once, at the start of a drain
WARN_EVERY_S = 300.0  # the same failure of one registry is logged again after this long
MAX_URL_CHARS = 2048
MAX_KEY_CHARS = 4096
REPLY_SNIPPET_BYTES = 512
_DNS_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


@dataclass(frozen=True)
class MembershipConfig:
    """The rosters this server joins (`parse` checks the flags that name them) and the host each
    of its URLs names; empty: it joins none."""

    vllm_proxies: tuple[str, ...] = ()
    sglang_bootstraps: tuple[str, ...] = ()
    vllm_host: str | None = None  # the host in the URL vLLM's proxies get (the HTTP face's)
    sglang_host: str | None = None  # the host in the URL SGLang's bootstrap servers get
    admin_key: str | None = field(default=None, repr=False)  # X-API-Key for vLLM's proxies
    period_s: float = ANNOUNCE_PERIOD_S

    @property
    def joins(self) -> bool:
        return bool(self.vllm_proxies or self.sglang_bootstraps)

    @classmethod
    def parse(cls, *, vllm_proxies: Iterable[str], sglang_bootstraps: Iterable[str], advertise_host: str | None,
              host: str, epd_host: str | None, admin_key: str | None) -> MembershipConfig:
        """From `--register-vllm-proxy`, `--register-sglang-bootstrap`, `--advertise-host`, the bind
        hosts (`--host`; `--epd-host`, where SGLang's routes listen when given) and `$ADMIN_API_KEY`.
        ValueError names the problem."""
        vllm = _registry_urls("--register-vllm-proxy", vllm_proxies)
        sglang = _registry_urls("--register-sglang-bootstrap", sglang_bootstraps)
        if advertise_host is not None:
            if not (vllm or sglang):
                raise ValueError("--advertise-host is the address --register-vllm-proxy and "
                                 "--register-sglang-bootstrap announce; give one of them, or drop it")
            advertise_host = _host("--advertise-host", advertise_host)
        if vllm and not admin_key:
            raise ValueError(f"--register-vllm-proxy needs ${ADMIN_KEY_ENV} (the proxy's admin key, sent as "
                             "X-API-Key; the proxy refuses registrations without it)")
        if admin_key and (len(admin_key) > MAX_KEY_CHARS or not (admin_key.isascii() and admin_key.isprintable())):
            raise ValueError(f"${ADMIN_KEY_ENV} must be at most {MAX_KEY_CHARS} printable ASCII characters "
                             "(it travels in a header)")

        def announced(flag: str, bind: str, listener: str) -> str:
            if advertise_host is not None:
                return advertise_host
            if _wildcard(bind):
                raise ValueError(f"{flag} announces this encoder's URL, but {listener} {bind!r} listens on every "
                                 "address, which names none another host can reach: give --advertise-host (this "
                                 "pod's or host's address or DNS name)")
            return _host(listener, bind)

        return cls(vllm_proxies=vllm, sglang_bootstraps=sglang,
                   vllm_host=announced("--register-vllm-proxy", host, "--host") if vllm else None,
                   sglang_host=announced("--register-sglang-bootstrap", epd_host or host,
                                         "--epd-host" if epd_host else "--host") if sglang else None,
                   admin_key=admin_key if vllm else None)


def _registry_urls(flag: str, urls: Iterable[str]) -> tuple[str, ...]:
    out: list[str] = []
    for text in urls:
        url = registry_url(flag, text)
        if url in out:
            raise ValueError(f"{flag} {text!r}: named twice")
        out.append(url)
    return tuple(out)


def registry_url(flag: str, text: str) -> str:
    """A registry's base URL as `flag` takes it: http(s), a host, no credentials, query or fragment;
    the trailing slash dropped. ValueError names the problem."""
    if problem := _url_problem(text):
        shown = "(a URL with credentials, not repeated here)" if "@" in text else repr(text)
        raise ValueError(f"{flag} {shown}: {problem}")
    parts = urllib.parse.urlsplit(text)
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def _url_problem(text: str) -> str | None:
    if len(text) > MAX_URL_CHARS or not (text.isascii() and text.isprintable()) or " " in text:
        return f"at most {MAX_URL_CHARS} printable ASCII characters, no spaces"
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https"):
        return "must be an http:// or https:// URL"
    if "@" in parts.netloc:
        return f"credentials do not go in the URL (vLLM's proxy takes ${ADMIN_KEY_ENV})"
    if not parts.hostname:
        return "names no host"
    try:
        parts.port  # noqa: B018 - raises on a port that is not one
    except ValueError:
        return "its port is not a port number"
    if parts.query or parts.fragment or "?" in text or "#" in text:
        return "the base URL only: no query or fragment"
    return None


def _wildcard(host: str) -> bool:
    try:
        return not host or ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _host(flag: str, text: str) -> str:
    """An IP address (not a wildcard) or a DNS name, as a URL's host: IPv6 in brackets."""
    bare = text.strip("[]") if text.startswith("[") and text.endswith("]") else text
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        if len(bare) > 253 or not _DNS_NAME.fullmatch(bare):
            raise ValueError(f"{flag} {text!r}: neither an IP address nor a DNS name") from None
        return bare
    if ip.is_unspecified:
        raise ValueError(f"{flag} {text!r}: a wildcard address names no host; give this host's address or name")
    return f"[{ip}]" if ip.version == 6 else str(ip)


@dataclass
class _Registry:
    """One roster this server is on: how it joins and leaves, and what it said last."""

    what: str  # "vLLM proxy", "SGLang bootstrap server"
    base: str
    me: str  # this server's URL on it
    join: tuple[str, str, dict[str, Any]]  # method, path, httpx arguments
    leave: tuple[str, str, dict[str, Any]]
    joined: bool = False
    failing: str | None = None  # the kind of the last failure (a status, an exception), while failing
    warned_at: float = float("-inf")


class Membership:
    """This server on every roster `config` names: `start` once serving, `leave` at the start of a
    drain, `close` when stopping without one. Create and use it on the server's event loop."""

    def __init__(self, config: MembershipConfig, *, scheme: str, http_port: int | None, epd_port: int | None,
                 serving: Callable[[], bool]) -> None:
        registries = []
        if config.vllm_proxies:
            if http_port is None:
                raise ValueError("joining vLLM's proxy needs the HTTP face (--http-port)")
            me = f"{scheme}://{config.vllm_host}:{http_port}"
            key = {"X-API-Key": config.admin_key or ""}
            join = ("POST", "/instances", {"json": {"role": "encode", "url": me}, "headers": key})
            leave = ("DELETE", "/instances", {"params": {"url": me}, "headers": key})
            registries += [_Registry("vLLM proxy", url, me, join, leave) for url in config.vllm_proxies]
        if config.sglang_bootstraps:
            port = epd_port or http_port
            if port is None:
                raise ValueError("joining SGLang's bootstrap server needs its routes (--http-port or --epd-port)")
            me = f"{scheme}://{config.sglang_host}:{port}"
            join = ("POST", "/register_encoder_url", {"json": {"url": me}})
            leave = ("DELETE", "/unregister_encoder_url", {"json": {"url": me}})
            registries += [_Registry("SGLang bootstrap server", url, me, join, leave)
                           for url in config.sglang_bootstraps]
        self._registries = registries
        self._period_s = config.period_s
        self._serving = serving
        # Nothing from the environment (a proxy, a netrc), no redirect followed: the key goes only
        # where the flag says.
        self._client = httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, trust_env=False, follow_redirects=False)
        self._task: asyncio.Task[None] | None = None
        self._done = False

    def start(self) -> None:
        """Join now and re-announce every period, in the background."""
        if self._task is None and not self._done:
            self._task = asyncio.create_task(self._announce())

    async def _announce(self) -> None:
        while True:
            if self._serving():
                await asyncio.gather(*(self._send(registry, "join", REQUEST_TIMEOUT_S)
                                       for registry in self._registries))
            await asyncio.sleep(self._period_s)

    async def leave(self) -> None:
        """Stop announcing and leave every roster at once, within `LEAVE_TIMEOUT_S` in all (nothing
        to leave when it never started)."""
        if self._done or self._task is None:
            await self.close()
            return
        await self._stop_announcing()
        await asyncio.gather(*(self._send(registry, "leave", LEAVE_TIMEOUT_S) for registry in self._registries))
        await self.close()

    async def close(self) -> None:
        """Stop announcing, leaving nothing (the rosters' probes will drop this server)."""
        self._done = True
        await self._stop_announcing()
        if not self._client.is_closed:
            await self._client.aclose()

    async def _stop_announcing(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _send(self, registry: _Registry, step: str, timeout_s: float) -> None:
        method, path, kwargs = registry.join if step == "join" else registry.leave
        kind = problem = None
        try:
            async with asyncio.timeout(timeout_s):
                async with self._client.stream(method, registry.base + path, **kwargs) as reply:
                    if not reply.is_success:
                        kind = f"HTTP {reply.status_code}"
                        problem = f"{kind} {await _snippet(reply)!r}"
        except TimeoutError:
            kind = problem = f"no answer within {timeout_s:g} s"
        except httpx.HTTPError as exc:  # its text names the failure, never the headers sent
            kind = type(exc).__name__
            problem = f"{kind}: {exc}" if str(exc) else kind
        self._report(registry, step, kind, problem)

    def _report(self, registry: _Registry, step: str, kind: str | None, problem: str | None) -> None:
        if step == "leave":
            if kind is None:
                log.info("left the %s %s", registry.what, registry.base)
            else:
                log.warning("could not leave the %s %s: %s (its health probes will drop this server)",
                            registry.what, registry.base, problem)
            return
        if kind is None:
            if not registry.joined or registry.failing is not None:
                log.info("joined the %s %s as %s", registry.what, registry.base, registry.me)
            registry.joined, registry.failing = True, None
            return
        now = time.monotonic()
        if kind != registry.failing or now - registry.warned_at >= WARN_EVERY_S:
            log.warning("could not join the %s %s: %s (tried again every %g s)", registry.what, registry.base,
                        problem, self._period_s)
            registry.warned_at = now
        registry.failing = kind


async def _snippet(reply: httpx.Response) -> str:
    """The start of a refusal's body, for the log (a reply of any size reads no further)."""
    head = b""
    async for chunk in reply.aiter_raw():
        head += chunk
        if len(head) >= REPLY_SNIPPET_BYTES:
            break
    return head[:REPLY_SNIPPET_BYTES].decode("utf-8", "replace")
