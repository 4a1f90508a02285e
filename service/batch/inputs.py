"""A batch job's inputs: a directory of images, an OpenAI-batch-style JSONL, or a list of paths.

Every input becomes an `Item` with a unique `custom_id` (the key that makes resume exactly-once).
The whole input is checked before any work starts: a malformed JSONL line or a repeated id stops
the job with the line named, rather than hours later. Image bytes are read lazily, per item, by
the worker that handles it, so a missing or unreadable file fails that item only.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from service.errors import Kind, ServiceError

# Suffixes (lower-cased) a directory scan picks up: what Pillow decodes and K3 takes as images.
IMAGE_EXTENSIONS = frozenset({
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".apng", ".gif", ".webp", ".bmp", ".dib", ".tif", ".tiff",
    ".ppm", ".pgm", ".pbm", ".pnm", ".tga", ".ico", ".avif", ".heic", ".heif", ".jp2", ".j2k",
})


class InputError(ValueError):
    """The job's input as a whole cannot be used (the message names the file and line)."""


class ItemError(ServiceError):
    """One item's image cannot be read. `transient`: worth retrying later (I/O), or not (bad URL)."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.kind = Kind.UNAVAILABLE if transient else Kind.BAD_INPUT


@dataclass(frozen=True)
class ImageRef:
    """Where one image's bytes come from: a file path, or an inline `data:` URL."""

    path: str | None = None
    data_url: str | None = None

    def read(self) -> bytes:
        if self.data_url is not None:
            return _decode_data_url(self.data_url)
        assert self.path is not None
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise ItemError(f"{self.path}: no such file", transient=False) from None
        except IsADirectoryError:
            raise ItemError(f"{self.path}: is a directory, not an image", transient=False) from None
        except OSError as e:  # permissions, NFS hiccups: worth another try on --resume
            raise ItemError(f"{self.path}: cannot read: {e.strerror or e}", transient=True) from None

    def describe(self) -> str:
        return self.path if self.path is not None else "inline data: URL"


@dataclass(frozen=True)
class Item:
    """One unit of work and one output row.

    `messages` is None for directory and list inputs (the job builds the chat from its task
    prompt); for JSONL rows it is the chat in the template's form, each image part reduced to
    `{"type": "image"}` and `images` holding those images in order.
    """

    custom_id: str
    images: tuple[ImageRef, ...]
    messages: tuple[dict[str, Any], ...] | None = None
    max_new_tokens: int | None = None  # a JSONL row's own `max_tokens` / `max_completion_tokens`

    def to_json(self) -> str:
        """The item as one JSON text (how the Ray engine hands items to its actors)."""
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Item:
        d = json.loads(text)
        messages = None if d["messages"] is None else tuple(d["messages"])
        return cls(d["custom_id"], tuple(ImageRef(**ref) for ref in d["images"]), messages, d["max_new_tokens"])


def load_items(source: str | os.PathLike[str]) -> list[Item]:
    """Items of a directory (recursive, by image extension), a `.jsonl` file, or any other file
    read as a list of image paths (one per line; blank lines and `#` comments skipped)."""
    path = Path(source)
    if path.is_dir():
        items = _scan_directory(path)
        if not items:
            raise InputError(f"{path}: no image files (by extension: {', '.join(sorted(IMAGE_EXTENSIONS))})")
    elif path.is_file():
        items = _read_jsonl(path) if path.suffix.lower() == ".jsonl" else _read_path_list(path)
        if not items:
            raise InputError(f"{path}: no inputs in the file")
    else:
        raise InputError(f"{path}: no such file or directory")
    _check_unique(items, path)
    return items


def _check_unique(items: Iterable[Item], source: Path) -> None:
    seen: set[str] = set()
    for item in items:
        if item.custom_id in seen:
            raise InputError(f"{source}: custom_id {item.custom_id!r} appears more than once; ids must be unique "
                             "(resume relies on them)")
        seen.add(item.custom_id)


def _scan_directory(root: Path) -> list[Item]:
    items = []
    # Symlinked directories are not followed (no cycles); symlinked files are read like files.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if Path(name).suffix.lower() in IMAGE_EXTENSIONS:
                full = Path(dirpath) / name
                custom_id = full.relative_to(root).as_posix()
                items.append(Item(custom_id, (ImageRef(path=str(full)),)))
    return items


def _read_path_list(path: Path) -> list[Item]:
    base = path.parent
    items = []
    for lineno, raw in enumerate(_lines(path), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        full = Path(line) if Path(line).is_absolute() else base / line
        try:
            custom_id = full.relative_to(base).as_posix()
        except ValueError:
            custom_id = Path(line).as_posix()
        if not custom_id or custom_id == ".":
            raise InputError(f"{path}:{lineno}: not an image path: {line!r}")
        items.append(Item(custom_id, (ImageRef(path=str(full)),)))
    return items


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); is it an image? "
                         "Give a directory, a .jsonl file or a list of paths") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None


def _read_jsonl(path: Path) -> list[Item]:
    items = []
    for lineno, raw in enumerate(_lines(path), 1):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None
        items.append(_jsonl_item(row, where, path.parent))
    return items


def _jsonl_item(row: Any, where: str, base: Path) -> Item:
    if not isinstance(row, Mapping):
        raise InputError(f"{where}: each line must be a JSON object")
    custom_id = row.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InputError(f"{where}: custom_id must be a non-empty string")
    body = row.get("body")
    if not isinstance(body, Mapping) or not isinstance(body.get("messages"), list) or not body["messages"]:
        raise InputError(f"{where}: body.messages must be a non-empty list (OpenAI batch format)")
    images: list[ImageRef] = []
    messages = tuple(_message(m, f"{where}: body.messages[{i}]", base, images)
                     for i, m in enumerate(body["messages"]))
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise InputError(f"{where}: body.max_tokens must be a positive integer, got {limit!r}")
    return Item(custom_id, tuple(images), messages, limit)


def _message(message: Any, where: str, base: Path, images: list[ImageRef]) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise InputError(f"{where}: a message is an object with a string role")
    content = message.get("content")
    if isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = [_part(p, f"{where}.content[{k}]", base, images) for k, p in enumerate(content)]
    else:
        raise InputError(f"{where}.content must be a string or a list of parts")
    return {"role": message["role"], "content": parts}


def _part(part: Any, where: str, base: Path, images: list[ImageRef]) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, Mapping) else spec
        if not isinstance(url, str) or not url:
            raise InputError(f"{where}: image_url.url must be a non-empty string")
        images.append(_image_ref(url, where, base))
        return {"type": "image"}
    raise InputError(f"{where}: a part is {{'type': 'text', 'text': ...}} or {{'type': 'image_url', ...}}")


def _image_ref(url: str, where: str, base: Path) -> ImageRef:
    if url.startswith("data:"):
        return ImageRef(data_url=url)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return ImageRef(path=unquote(parsed.path))
    if parsed.scheme in ("http", "https"):
        raise InputError(f"{where}: remote image URLs are not fetched ({url[:80]}); download the images first "
                         "or use file paths / data: URLs")
    return ImageRef(path=str(Path(url) if Path(url).is_absolute() else base / url))


def _decode_data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ItemError("a data: URL must be base64 (data:image/...;base64,...)", transient=False)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ItemError(f"data: URL is not valid base64: {e}", transient=False) from None
