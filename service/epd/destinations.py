"""Where the encoder may connect out: the one rule for every push destination an SGLang request
names (`/encode`'s `prefill_host` and `embedding_port`) or registers (`/scheduler_receive_url`'s
`receive_url`). Whoever can reach the EPD routes can name an address, and SGLang's language side
sends no credentials, so the operator says which addresses may be pushed to
(`--epd-allowed-destinations`, parsed once into a `DestinationRule`) and every destination is
checked against it before any connection:

- entries, comma-separated (the flag is repeatable): `peer` (the address of the HTTP caller that
  names or registers the destination: the default, which serves a language server that names its
  own host), an IP address, a CIDR (`10.0.0.0/8`, `[fd00::/8]`) or a host name (resolved once, at
  start); each optionally with `:PORT` or `:LOW-HIGH` (an IPv6 address or CIDR in brackets then);
- a destination is allowed when one entry holds its address and its port, and it is never one of
  this server's own listening ports on one of this machine's addresses;
- a host name a request gives is resolved once, every address it resolves to must be allowed, and
  the push connects to the checked address (no second lookup that could answer otherwise).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from service.errors import BadRequest, Unavailable

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
PEER = "peer"
DEFAULT = (PEER,)
RESOLVE_TIMEOUT_S = 5.0  # a request's host name must resolve within this (else 503, retryable)
MAX_LOOKUPS = 16  # host names of requests being resolved at once (each a thread's wait; more: 503)
FLAG = "--epd-allowed-destinations"


def _ip(text: str) -> IP:
    """An address as the rule compares it (an IPv4-mapped IPv6 address is its IPv4 one)."""
    ip = ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


@dataclass(frozen=True)
class Address:
    """A checked destination: an IP (never a name) and a port."""

    ip: IP
    port: int

    def __str__(self) -> str:
        return f"[{self.ip}]:{self.port}" if self.ip.version == 6 else f"{self.ip}:{self.port}"

    @property
    def url(self) -> str:
        return f"tcp://{self}"


@dataclass(frozen=True)
class Named:
    """A destination as a request names it, not yet checked: a host (a name or an address) and its ports."""

    host: str
    ports: tuple[int, ...]


def split_host_port(text: str) -> tuple[str, str | None]:
    """`host`, `host:port`, `[v6]`, `[v6]:port`, `[v6/len]:port`: the host and the port text (None: absent)."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r}: an IPv6 address is written [address] or [address]:port")
        return host, rest[1:] if rest else None
    if text.count(":") > 1:  # a bare IPv6 address (or network), no port
        return text, None
    host, colon, port = text.partition(":")
    return host, port if colon else None


def _port_range(text: str) -> tuple[int, int]:
    low, dash, high = text.partition("-")
    if not (low.isdigit() and (not dash or high.isdigit())):
        raise ValueError(f"{text!r} is not a port or a LOW-HIGH port range")
    first, last = int(low), int(high) if dash else int(low)
    if not 1 <= first <= last <= 65535:
        raise ValueError(f"{text!r} is not a port range within 1..65535")
    return first, last


@dataclass(frozen=True)
class Entry:
    """One allowed place: the caller's own address (`peer`) or these networks, on these ports (None: any)."""

    text: str
    networks: tuple[Network, ...]  # empty for `peer`
    ports: tuple[int, int] | None

    def holds(self, ip: IP, port: int, peer: IP | None) -> bool:
        if self.ports is not None and not self.ports[0] <= port <= self.ports[1]:
            return False
        if not self.networks:
            return peer is not None and ip == peer
        return any(ip in network for network in self.networks)


def _entry(text: str) -> Entry:
    host, port = split_host_port(text)
    ports = None if port is None else _port_range(port)
    if host == PEER:
        return Entry(text, (), ports)
    try:
        return Entry(text, (ipaddress.ip_network(host, strict=False),), ports)
    except ValueError:
        pass
    try:  # a host name: its addresses now, once
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"{host!r} is neither peer, an address, a CIDR nor a host name that resolves "
                         f"({exc.strerror or exc})") from None
    addresses = {_ip(str(info[4][0])) for info in infos}
    return Entry(text, tuple(ipaddress.ip_network(a) for a in sorted(addresses, key=str)), ports)


@dataclass(frozen=True)
class DestinationRule:
    """The operator's allowed destinations (`--epd-allowed-destinations`), parsed once."""

    entries: tuple[Entry, ...]

    @classmethod
    def parse(cls, texts: Iterable[str] = DEFAULT) -> DestinationRule:
        """From the flag's values (each a comma list); ValueError names what is wrong."""
        parts = [part.strip() for text in texts for part in text.split(",")]
        if not parts or any(not part for part in parts):
            raise ValueError(f"{FLAG} takes a comma list of peer, addresses, CIDRs or host names, each with an "
                             f"optional :PORT or :LOW-HIGH; got {','.join(parts)!r}")
        entries = []
        for part in parts:
            try:
                entries.append(_entry(part))
            except ValueError as exc:
                raise ValueError(f"{FLAG}: {exc}") from None
        return cls(tuple(entries))

    def __str__(self) -> str:
        return ",".join(entry.text for entry in self.entries)

    def allows(self, ip: IP, port: int, peer: IP | None) -> bool:
        return any(entry.holds(ip, port, peer) for entry in self.entries)


@functools.lru_cache(maxsize=1024)
def _local(ip: IP) -> bool:
    """Whether `ip` is one of this machine's addresses: only those can be bound (no packet is sent)."""
    if ip.is_loopback or ip.is_unspecified:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(ip), 0))
        except OSError:
            return False
    return True


class Guard:
    """The rule where requests meet it: a named destination resolved once and checked, address by
    address, against the rule and this server's own listening ports (`own_ports`, read at each check:
    they are known once the server bound them)."""

    def __init__(self, rule: DestinationRule, own_ports: Callable[[], Iterable[int]]) -> None:
        self.rule = rule
        self._own_ports = own_ports
        self._lookups = 0

    async def check(self, named: Named, peer: str | None) -> tuple[Address, ...]:
        """The checked addresses, one per port (BadRequest naming the rule: not allowed)."""
        caller = peer_address(peer)
        ips = await self._resolve(named.host)
        own = set(self._own_ports())
        for ip in ips:
            for port in named.ports:
                shown = named.host if named.host.strip("[]") == str(ip) else f"{named.host} ({ip})"
                if port in own and _is_local(ip):
                    raise BadRequest(f"the destination {shown} port {port} is one of this server's own listening "
                                     "ports; it is never pushed to")
                if not self.rule.allows(ip, port, caller):
                    whose = f"; the caller is {caller}" if caller is not None else ""
                    raise BadRequest(f"the destination {shown} port {port} is not allowed by {FLAG} "
                                     f"{self.rule}{whose}")
        return tuple(Address(ips[0], port) for port in named.ports)

    async def _resolve(self, host: str) -> list[IP]:
        try:
            return [_ip(host)]
        except ValueError:
            pass
        if self._lookups >= MAX_LOOKUPS:
            raise Unavailable(f"{MAX_LOOKUPS} destination host names are being resolved; retry shortly")
        self._lookups += 1
        try:
            return await _lookup(host)
        finally:
            self._lookups -= 1


def peer_address(peer: str | None) -> IP | None:
    """The caller's address as the rule compares it (None: unknown)."""
    try:
        return _ip(peer) if peer else None
    except ValueError:
        return None


def _is_local(ip: IP) -> bool:
    try:
        return _local(ip)
    except OSError as exc:  # the probe socket itself could not be made
        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            raise Unavailable(f"cannot check the destination now: {exc.strerror}; retry shortly") from None
        raise


async def _lookup(host: str) -> list[IP]:
    """The host name's addresses, from one lookup within RESOLVE_TIMEOUT_S."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except TimeoutError:
        raise Unavailable(f"the host {host!r} did not resolve within {RESOLVE_TIMEOUT_S:g} s; retry") from None
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:
            raise Unavailable(f"the host {host!r} could not be resolved now ({exc.strerror}); retry") from None
        raise BadRequest(f"the host {host!r} does not resolve ({exc.strerror})") from None
    except OSError as exc:
        raise Unavailable(f"the host {host!r} could not be resolved now ({exc.strerror or exc}); retry") from None
    ips = list(dict.fromkeys(_ip(str(info[4][0])) for info in infos))
    if not ips:
        raise BadRequest(f"the host {host!r} resolves to no address")
    return ips
