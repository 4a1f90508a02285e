"""The encoder-cache store: vLLM's directory of encoder outputs, shared by every encoder that
writes to it (`--ec-export-dir`), so an image one instance encoded is a file the others serve.

vLLM's shared-storage encoder-cache connector (`ECExampleConnector`, encoder disaggregation) loads
`<dir>/<key>/encoder_cache.safetensors` and takes its single tensor `ec_cache` ([num_tokens,
hidden_size]) as the encoder output of the item vLLM keys by `key`: the client's item uuid if it
sent one, else the `mm_hash` vLLM computes, which `mm_hash` below reproduces (vLLM 0.33,
`vllm/multimodal/hasher.py`; checked against goldens vLLM computed, tests/test_vllm_hash.py): the
digest (blake3 by default) of a self-delimiting stream of the keyword items `image` (the original
encoded bytes, as received) and `model_id` (the model string the vLLM instance was started with).

The engine goes through the store (`Store.through`) for every item whose preprocessing is the
default, the only one vLLM's key stands for; the rules, each of which makes a file trustworthy to
a reader that knows nothing but its name:

- **An entry is never replaced.** The first writer's file stays (`service.files.atomic_path` with
  `replace=False`: of two racing writers exactly one links its file in). Each file records the
  `mm_hash` of the image it holds and the checkpoint fingerprint that encoded it (`IMAGE_HASH`,
  `CHECKPOINT`, its metadata; vLLM reads the tensor alone). A lookup is a hit only when both are
  this item's and this engine's, and the rows are the store's dtype (`STORE_DTYPE`, bf16: what
  vLLM's decoders run K3 in). Every row the store serves or writes is in that dtype, so an answer
  does not depend on which instance encoded the image, or whether it was a hit.
- **Each image is encoded once across the fleet.** An instance about to encode takes a lease on the
  key (`<dir>/.leases/<key>`: a file naming its owner and expiry, created by a hard link, which is
  atomic on NFS as on a local disk, where exclusive `open` is not on old NFS). The others poll for
  the entry while the lease lives; a lease past its expiry (its owner died, or is slower than
  `lease_s`) is taken over. A lease is an economy, not a lock: a race on one (two instances taking
  over one stale lease at once) costs an encode twice, never a wrong row, because the entry itself
  is first-writer-wins. Expiries are wall-clock times: the instances' clocks must agree to well
  under `lease_s` (NTP does).
- **The store is bounded** when given `max_bytes`: after a write, least recently used entries (by
  the file's mtime, which a hit renews) are evicted until the entries fit, never one younger than
  `min_age_s` (a decoder just told about a file must find it). Eviction renames the entry's
  directory away first (atomic: of several instances evicting one entry, one does), so a reader
  sees the whole file or none. A scan reads every entry; it runs only when this instance's count
  says the budget is passed, or its last scan is older than `RESCAN_S` (other instances write too).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import blake3
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from service.engine.config import HASH_ALGORITHMS
from service.errors import BadRequest, Unavailable
from service.files import atomic_path

# A key is one path component of plain characters: no separator, dot-dot, NUL or newline can be
# in it, and it fits a file name (255 bytes) with room. fullmatch, not `$`: `$` lets "name\n" by.
_KEY = re.compile(r"[0-9A-Za-z_-]{1,128}")
UUID_RULE = "1 to 128 characters, each a letter (A-Z, a-z), a digit, '_' or '-'"
# The hex digests vLLM's --mm-hasher-algorithm choices give (service.engine.config.HASH_ALGORITHMS:
# blake3 and sha256 64 digits, sha512 128); sha256's 64 are also the key vLLM's EPD proxy sets.
_HASH_SHAPED = re.compile(r"[0-9a-fA-F]{64}|[0-9a-fA-F]{128}")


def is_key(text: str) -> bool:
    """Whether `text` follows `UUID_RULE` (a vLLM encoder-cache key: an mm_hash or a client's uuid)."""
    return _KEY.fullmatch(text) is not None


def hash_shaped(key: str) -> bool:
    """Whether `key` has the form of a content hash (hex of a length vLLM's hashes have)."""
    return _HASH_SHAPED.fullmatch(key) is not None


FILE_NAME = "encoder_cache.safetensors"
TENSOR_NAME = "ec_cache"
IMAGE_HASH = "mm_hash"  # the file's metadata entry naming the image it holds
CHECKPOINT = "kimi_vision_checkpoint"  # ... and the checkpoint fingerprint that encoded it
STORE_DTYPE = torch.bfloat16
LEASES = ".leases"  # not a key: keys have no '.' (UUID_RULE)
RESCAN_S = 5.0
POLL_S = (0.02, 0.25)  # first and longest wait between two looks for another instance's entry
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}  # safetensors' dtype names, as torch's
_PLAIN = b"\x03"  # the framing's tag of a plain value (None 0x00, sequence 0x01, mapping 0x02)


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data  # u64 little-endian byte count, then the bytes


def _framed(data: bytes, model_id: str) -> Iterator[bytes]:
    """The chunks vLLM feeds its digest: the keyword items in sorted name order (`image`,
    `model_id`), each as its name, the plain-value tag and the value; the image item is itself a
    nested (name `image`, tag, original bytes) pair."""
    yield from (_length_prefixed(b"image"), _PLAIN, _length_prefixed(b"image"), _PLAIN, _length_prefixed(data))
    yield from (_length_prefixed(b"model_id"), _PLAIN, _length_prefixed(model_id.encode()))


def mm_hash(data: bytes, model_id: str, algorithm: str = "blake3") -> str:
    """vLLM's `mm_hash` of an image reaching its OpenAI server as `data` (for a `data:` URL: the
    decoded payload), under `model_id`: lowercase hex (64 chars; 128 for sha512)."""
    if algorithm not in HASH_ALGORITHMS:
        raise ValueError(f"hash algorithm must be one of {HASH_ALGORITHMS}, got {algorithm!r}")
    digest = blake3.blake3() if algorithm == "blake3" else hashlib.new(algorithm)
    for chunk in _framed(bytes(data), model_id):
        digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class ItemKey:
    key: str  # what vLLM finds the item by: the client's uuid, else `image`
    image: str  # the item's own mm_hash, which its file records


class Keyed(Protocol):
    """What a key is made of: an item's bytes, its client's uuid and the URL it came by."""

    data: bytes
    uuid: str | None
    url: str | None
    where: str


def _key(uuid: str | None, image: str, url: str | None, where: str) -> str:
    if uuid is None:
        return image
    if not is_key(uuid):  # every face refused it already; a direct caller may not have
        raise BadRequest(f"{where}: uuid must be {UUID_RULE}, got {uuid[:60]!r}")
    if hash_shaped(uuid) and uuid != image and (url is None or uuid != hashlib.sha256(url.encode()).hexdigest()):
        raise BadRequest(f"{where}: uuid {uuid!r} has the form of a content hash but is not this image's own (its "
                         "vLLM mm_hash, or the sha256 of its URL): a hash-shaped uuid must be the item's own key")
    return uuid


def item_key(data: bytes, uuid: str | None, model_id: str, algorithm: str = "blake3", *,
             url: str | None = None, where: str = "image") -> str:
    """The key vLLM files an image under: the client's `uuid` verbatim when it sent one, else
    `mm_hash`; a hash-shaped uuid that is not the item's own is a BadRequest (a client naming it
    could take the key another image is, or will be, filed under)."""
    return _key(uuid, mm_hash(data, model_id, algorithm), url, where)


def item_keys(media: Sequence[Keyed], model_id: str, algorithm: str) -> list[ItemKey]:
    """Each item's key and mm_hash (blocking: it hashes the bytes; run it off the event loop)."""
    out = []
    for item in media:
        image = mm_hash(item.data, model_id, algorithm)
        out.append(ItemKey(_key(item.uuid, image, item.url, item.where or "image"), image))
    return out


def ec_path(directory: str | Path, key: str) -> Path:
    if not is_key(key):
        raise ValueError(f"not a usable encoder-cache key ({UUID_RULE}): {key[:60]!r}")
    return Path(directory) / key / FILE_NAME


@dataclass(frozen=True)
class _Held:
    image: str | None  # the mm_hash an entry records (None: a file written without one)
    checkpoint: str | None
    dtype: str  # torch's name


def _held(path: Path) -> _Held:
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            dtype = str(f.get_slice(TENSOR_NAME).get_dtype())
    except (OSError, SafetensorError, KeyError) as exc:
        raise BadRequest(f"the encoder-cache entry {path.parent.name!r} exists but is not a readable "
                         f"{FILE_NAME} ({type(exc).__name__}); use another key") from None
    return _Held(meta.get(IMAGE_HASH), meta.get(CHECKPOINT), _DTYPES.get(dtype, dtype))


def write_ec(directory: str | Path, key: str, embedding: torch.Tensor, image: str | None = None,
             where: str = "image", checkpoint: str | None = None) -> Path:
    """Write one item's embedding under `key`, unless the entry exists: it is never replaced (of
    two racing writers one wins). `image`, `checkpoint`: the item's mm_hash and the fingerprint of
    the checkpoint that encoded it, recorded in the file; an existing entry recording another image,
    or holding another dtype, is a BadRequest (the key is taken).

    Atomically (`service.files.atomic_path`): a reader never sees half a file. Not durably
    (`durable=False`): this runs per image on the request path, where a file fsync and a directory
    fsync each would wait on the disk; the store needs the link, not the file to outlive a power loss."""
    if embedding.dim() != 2:
        raise ValueError(f"an encoder-cache entry is [num_tokens, hidden], got shape {tuple(embedding.shape)}")
    target = ec_path(directory, key)
    rows = embedding.detach().to("cpu").contiguous()
    meta = {name: value for name, value in ((IMAGE_HASH, image), (CHECKPOINT, checkpoint)) if value is not None}
    try:
        with atomic_path(target, durable=False, replace=False) as tmp:
            save_file({TENSOR_NAME: rows}, str(tmp), metadata=meta or None)
    except OSError as exc:
        if not (isinstance(exc, FileExistsError) and target.is_file()):
            # A full, read-only or cluttered store is the operator's to mend; the request may retry.
            raise Unavailable(f"cannot write the encoder-cache entry for {where}: {exc.strerror or exc}") from None
        held = _held(target)
        ours = str(rows.dtype).removeprefix("torch.")
        if image is not None and held.image not in (None, image):
            taken = "another image's embeddings"
        elif held.dtype != ours:
            taken = f"{held.dtype} rows, not {ours}"
        else:
            return target
        raise BadRequest(f"{where}: the key {key!r} already holds {taken}; an entry is never replaced (the first "
                         "writer's stays): send a uuid of your own") from None
    return target


@dataclass(frozen=True)
class Lease:
    path: Path
    owner: str


class StoreCounts(Protocol):
    """What the store reports (`service.metrics.Metrics`)."""

    def store_lookup(self, hit: bool) -> None: ...
    def store_lease_wait(self) -> None: ...
    def store_evicted(self, entries: int, nbytes: int) -> None: ...


@dataclass(frozen=True)
class StoreConfig:
    directory: Path
    model_id: str
    algorithm: str
    checkpoint: str  # the engine's checkpoint fingerprint: only its own entries are hits
    client_uuids: str = "accept"
    lease_s: float = 30.0
    max_bytes: int | None = None  # None: unbounded
    min_age_s: float = 300.0


class Store:
    """One engine's view of a store directory (module docstring). Blocking methods run on the
    engine's CPU threads; `through` is the engine's one entry."""

    def __init__(self, config: StoreConfig, counts: StoreCounts) -> None:
        self.config = config
        self.counts = counts
        self.directory = config.directory
        self.leases = config.directory / LEASES
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._lock = threading.Lock()
        self._bytes = 0  # the entries' size at the last scan, plus what this instance wrote since
        self._scanned = 0.0  # time.monotonic() of the last scan

    def key(self, item: Keyed) -> ItemKey | None:
        """The item's key, or None for one the store does not take: a uuid the export refuses
        (a hash-shaped one not the item's own; under client_uuids "content", any freely named)."""
        image = mm_hash(item.data, self.config.model_id, self.config.algorithm)
        if item.uuid is not None and self.config.client_uuids == "content" and not hash_shaped(item.uuid):
            return None
        try:
            return ItemKey(_key(item.uuid, image, item.url, item.where or "image"), image)
        except BadRequest:
            return None

    async def through(self, key: ItemKey, shape: tuple[int, int], encode: Callable[[], Awaitable[torch.Tensor]],
                      run: Callable[..., asyncio.Future], where: str) -> tuple[torch.Tensor, bool]:
        """The item's rows and whether the store had them: its entry if it holds them (`shape`:
        the rows the item's plan makes); else, under this instance's lease, `encode()`'s rows in the
        store's dtype, written as the entry; while another instance's lease lives, its entry once it
        lands. `run(fn, *args)`: starts blocking work off the event loop."""
        delay = POLL_S[0]
        waited = False
        while True:
            rows = await run(self.lookup, key, shape)
            if rows is not None:
                self.counts.store_lookup(hit=True)
                return rows, True
            lease = await run(self.take, key.key)
            if isinstance(lease, Lease):
                break
            if not waited:  # another instance is encoding it: wait for its entry
                self.counts.store_lease_wait()
                waited = True
            await asyncio.sleep(min(delay, max(lease, 0.0) + 0.001))
            delay = min(delay * 2, POLL_S[1])
        self.counts.store_lookup(hit=False)
        try:
            rows = (await encode()).to(STORE_DTYPE)
            await run(self.put, key, rows, where)
        finally:
            run(self._release, lease)  # started, not awaited: a cancelled encode gives its lease back too
        return rows, False

    def lookup(self, key: ItemKey, shape: tuple[int, int]) -> torch.Tensor | None:
        """The entry's rows if it holds this image, encoded by this checkpoint, in the store's dtype
        and `shape`; its use is recorded (the file's mtime) for eviction."""
        path = ec_path(self.directory, key.key)
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                if meta.get(IMAGE_HASH) != key.image or meta.get(CHECKPOINT) != self.config.checkpoint:
                    return None
                rows = f.get_tensor(TENSOR_NAME)
        except (OSError, SafetensorError, KeyError):  # absent, being evicted, or not ours to read
            return None
        if rows.dtype != STORE_DTYPE or tuple(rows.shape) != shape:
            return None
        try:
            os.utime(path)
        except OSError:
            pass  # evicted meanwhile: the rows read are whole
        return rows

    def take(self, key: str) -> Lease | float:
        """This instance's lease on `key`, or the seconds the holder's lease has left."""
        self.leases.mkdir(parents=True, exist_ok=True)
        path = self.leases / key
        for _ in range(2):  # a stale lease found is moved away once, then the link is tried again
            owner = f"{self._owner}:{secrets.token_hex(4)}"
            tmp = self.leases / f".{key}.{secrets.token_hex(6)}.tmp"
            tmp.write_text(json.dumps({"owner": owner, "expires": time.time() + self.config.lease_s}))
            try:
                os.link(tmp, path)
                return Lease(path, owner)
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
            left = self._left(path)
            if left > 0:
                return left
            stale = self.leases / f".{key}.{secrets.token_hex(6)}.stale"
            try:
                os.rename(path, stale)  # of several instances taking it over, one moves it
                stale.unlink()
            except FileNotFoundError:
                pass
        return POLL_S[0]  # another instance took it over just now: look again soon

    def _left(self, path: Path) -> float:
        """Seconds the lease at `path` has left (0: expired, or unreadable and older than a lease)."""
        try:
            expires = float(json.loads(path.read_text())["expires"])
        except FileNotFoundError:
            return 0.0
        except (OSError, ValueError, KeyError, TypeError):  # being written (a link is whole), or damaged
            try:
                expires = path.stat().st_mtime + self.config.lease_s
            except OSError:
                return 0.0
        return max(0.0, expires - time.time())

    def _release(self, lease: Lease) -> None:
        try:
            if json.loads(lease.path.read_text()).get("owner") == lease.owner:
                lease.path.unlink()
        except (OSError, ValueError):
            pass  # taken over after it expired, or gone: not ours to remove

    def put(self, key: ItemKey, rows: torch.Tensor, where: str) -> None:
        """Write the entry (another instance's that landed first is kept), then keep the budget."""
        try:
            path = write_ec(self.directory, key.key, rows, key.image, where, self.config.checkpoint)
        except BadRequest:
            return  # the key holds another image or dtype: the answer stands, the entry is not ours
        if self.config.max_bytes is None:
            return
        with self._lock:
            self._bytes += path.stat().st_size
            due = self._bytes > self.config.max_bytes or time.monotonic() - self._scanned > RESCAN_S
        if due:
            self.evict()

    def evict(self) -> None:
        """Least recently used entries older than the minimum age, until the rest fit the budget."""
        assert self.config.max_bytes is not None, "evict under a budget"
        now = time.time()
        abandoned = now - self.config.lease_s - self.config.min_age_s  # what a killed writer left
        entries = []
        for entry in os.scandir(self.directory):
            if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                st = os.stat(os.path.join(entry.path, FILE_NAME))
            except OSError:  # being written (or evicted by another instance), or its writer died
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_mtime < abandoned:
                        self._remove(entry.name)
                continue
            entries.append((st.st_mtime, st.st_size, entry.name))
        with contextlib.suppress(OSError):
            for lease in os.scandir(self.leases):  # a dead owner's lease on an image no one asked for again
                with contextlib.suppress(OSError):
                    if lease.stat(follow_symlinks=False).st_mtime < abandoned:
                        os.unlink(lease.path)
        total = sum(size for _, size, _ in entries)
        evicted = 0
        for mtime, size, name in sorted(entries):
            if total <= self.config.max_bytes or now - mtime < self.config.min_age_s:
                break
            total -= size  # gone either way: by this instance, or another that evicted it first
            evicted += self._remove(name)
        with self._lock:
            self._bytes = total
            self._scanned = time.monotonic()
        self.counts.store_evicted(evicted, total)

    def _remove(self, name: str) -> bool:
        """Remove an entry's directory: renamed away first (atomic: of several instances removing
        it, one does; a reader sees the whole file or none), then deleted."""
        gone = self.directory / f".{name}.{secrets.token_hex(6)}.evicted"
        try:
            os.rename(self.directory / name, gone)
        except OSError:
            return False
        shutil.rmtree(gone, ignore_errors=True)
        return True
