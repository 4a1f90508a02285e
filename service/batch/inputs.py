"""A batch job's inputs: an OpenAI-batch JSONL, a directory of images, or a list of image paths.

Every input becomes an `Item`: its `custom_id` (the key that makes resume exactly-once), its input
position `line` (by which the finished output is ordered) and the request it carries, in the
OpenAI batch form (`custom_id`, `method`, `url`, `body`). A directory or a path list becomes the
same requests (a user message with the image and the task's prompt), so every input goes down one
path. A JSONL line is only split off and parsed as JSON here (nested at most as deep as every face
allows: `load_json`); what it asks for is checked when it runs (`requests.py`). So a malformed line
is one error row naming its line, never the end of the job; so is a line repeating an earlier
`custom_id` (its row gets the id `<line N>`, and the first line keeps the id). Only an input that
cannot be read at all stops the job before it starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.batch.ids import IdTable
from service.batch.spec import JobSpec
from service.errors import BadRequest
from service.jsontext import load_json

CHAT_URL = "/v1/chat/completions"
EMBEDDINGS_URL = "/v1/embeddings"
# Suffixes (lower-cased) a directory scan picks up: what Pillow decodes and K3 takes as images.
IMAGE_EXTENSIONS = frozenset({
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".apng", ".gif", ".webp", ".bmp", ".dib", ".tif", ".tiff",
    ".ppm", ".pgm", ".pbm", ".pnm", ".tga", ".ico", ".avif", ".heic", ".heif", ".jp2", ".j2k",
})


class InputError(ValueError):
    """The job's input as a whole cannot be used (the message names the file)."""


@dataclass(frozen=True)
class Item:
    """One input line: one unit of work and one output row."""

    custom_id: str  # "" until `load_items` gives a line without one its own
    line: int  # the line in a JSONL or path list; the place in a directory's sorted listing
    request: dict[str, Any] | None  # the line's object (custom_id, method, url, body); None: not one
    problem: str | None = None  # why the line is not a request at all (not JSON, no custom_id, ...)
    numbered: bool = True  # the input has lines, so errors name it ("line 7: ..."); not for a directory


def image_request(custom_id: str, path: str, spec: JobSpec) -> dict[str, Any]:
    """The request a directory or path-list image makes: the image, then the task's prompt."""
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": path}}]
    if spec.task == "embed":
        url = EMBEDDINGS_URL
    else:
        url = CHAT_URL
        content.append({"type": "text", "text": spec.effective_prompt})
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"messages": [{"role": "user",
                                                                                       "content": content}]}}


def base_dir(source: str | os.PathLike[str]) -> Path:
    """Where an input's relative image paths are read from: the directory itself, or the file's."""
    path = Path(os.path.abspath(source))
    return path if path.is_dir() else path.parent


def load_items(source: str | os.PathLike[str], spec: JobSpec) -> Inputs:
    """The items of a directory (recursive, by image extension), a `.jsonl` file, or any other file
    read as a list of image paths (one per line; blank lines and `#` comments skipped).

    Reads the input once through to count its items (raising `InputError` for an input that cannot
    be used at all); the items themselves are read when the job takes them."""
    return Inputs(Path(source), spec)


class Inputs:
    """An input's items, read lazily: each iteration reads the source again, a line at a time as
    the job takes them, so memory does not grow with the input (a directory walk holds the sorted
    listing of each directory it is in; `_unique` a 24-byte hash per id). `len()`: how many."""

    def __init__(self, source: Path, spec: JobSpec) -> None:
        self.source = source
        self.spec = spec
        if source.is_dir():
            self.kind = "directory"
            empty = f"{source}: no image files (by extension: {', '.join(sorted(IMAGE_EXTENSIONS))})"
        elif source.is_file():
            self.kind = "jsonl" if source.suffix.lower() == ".jsonl" else "paths"
            empty = f"{source}: no inputs in the file"
        else:
            raise InputError(f"{source}: no such file or directory")
        self.count = sum(1 for _ in self._lines())
        if not self.count:
            raise InputError(empty)

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Item]:
        lines = self._lines()
        if self.kind == "directory":
            items = (Item(custom_id, position, image_request(custom_id, full, self.spec), numbered=False)
                     for position, (custom_id, full) in enumerate(lines, 1))
        elif self.kind == "jsonl":
            items = (_jsonl_item(raw, lineno) for lineno, raw in lines)
        else:
            items = (_path_item(lineno, line, self.source.parent, self.spec) for lineno, line in lines)
        return _unique(items)

    def _lines(self) -> Iterator[Any]:
        """What the items are made of, one per item (all the count reads)."""
        if self.kind == "directory":
            return _image_files(self.source)
        return _jsonl_lines(self.source) if self.kind == "jsonl" else _path_lines(self.source)


def _unique(items: Iterable[Item]) -> Iterator[Item]:
    """Give a line without an id one of its own (`<line N>`); a repeated custom_id makes that line
    an error row under such an id."""
    first = IdTable()  # every id so far -> its line
    for item in items:
        if not item.custom_id:
            item = dataclasses.replace(item, custom_id=_line_id(item.line, first))
        elif (earlier := first.insert(item.custom_id, item.line)) is not None:
            problem = (f"custom_id {item.custom_id!r} is already the id of line {earlier}; ids must be "
                       "unique (this row's id is its line)")
            item = dataclasses.replace(item, custom_id=_line_id(item.line, first), request=None, problem=problem)
        yield item


def _line_id(line: int, taken: IdTable) -> str:
    """The id of a line that has none of its own (unique even if a real id looks like it), taken."""
    custom_id = f"<line {line}>"
    while taken.insert(custom_id, line) is not None:
        custom_id += "'"
    return custom_id


def _image_files(root: Path) -> Iterator[tuple[str, str]]:
    """(custom_id, absolute path) of each image under `root`, in the order of their custom_ids
    (relative, `/`-separated): a directory's entries are sorted with a subdirectory named as its
    paths begin (`name/`), so that order comes out of a walk holding one listing per level.
    Symlinked directories are not followed (no cycles); symlinked files are read like files;
    a directory that cannot be listed is passed over, as `os.walk` passes it."""

    def walk(directory: str, prefix: str) -> Iterator[tuple[str, str]]:
        names = []
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    try:
                        is_dir = entry.is_dir()
                    except OSError:
                        is_dir = False
                    if is_dir:
                        if not entry.is_symlink():
                            names.append(entry.name + "/")
                    elif Path(entry.name).suffix.lower() in IMAGE_EXTENSIONS:
                        names.append(entry.name)
        except OSError:
            return
        names.sort()
        for name in names:
            if name.endswith("/"):
                yield from walk(os.path.join(directory, name[:-1]), prefix + name)
            else:
                yield prefix + name, os.path.join(directory, name)

    return walk(os.path.abspath(root), "")


def _path_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, path) of each path: lines end at \\n, \\r\\n or \\r (as Python reads text);
    blank lines and `#` comments are skipped."""
    lineno = offset = 0
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {offset + e.start}); is it an "
                                     "image? Give a directory, a .jsonl file or a list of paths") from None
                offset += len(raw)
                text = text.removesuffix("\n").removesuffix("\r")
                for part in text.split("\r"):
                    lineno += 1
                    line = part.strip()
                    if line and not line.startswith("#"):
                        yield lineno, line
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None


def _path_item(lineno: int, line: str, base: Path, spec: JobSpec) -> Item:
    full = Path(line) if Path(line).is_absolute() else base / line
    try:
        custom_id = full.relative_to(base).as_posix()
    except ValueError:
        custom_id = Path(line).as_posix()
    return Item(custom_id, lineno, image_request(custom_id, os.path.abspath(full), spec))


def _jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Split on b"\\n" only (a JSON string may hold U+2028 and other characters `str.splitlines`
    would cut at); blank lines are skipped, as vLLM's `run_batch` skips them."""
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if raw.strip():
                    yield lineno, raw
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None


def _jsonl_item(raw: bytes, lineno: int) -> Item:
    try:
        row = load_json(raw.decode("utf-8"), "the line")  # the faces' depth rule
    except UnicodeDecodeError as e:
        return Item("", lineno, None, f"not UTF-8 text ({e.reason} at byte {e.start})")
    except json.JSONDecodeError as e:
        return Item("", lineno, None, f"not valid JSON: {e.msg} (column {e.colno})")
    except BadRequest as e:
        return Item("", lineno, None, str(e))
    if not isinstance(row, dict):
        return Item("", lineno, None,
                    f"a line must be a JSON object (custom_id, method, url, body), got {type(row).__name__}")
    custom_id = row.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Item("", lineno, None, f"custom_id must be a non-empty string, got {custom_id!r}")
    return Item(custom_id, lineno, row)
