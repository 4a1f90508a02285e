"""A batch job's inputs: an OpenAI-batch JSONL, a directory of images, or a list of image paths.

Every input becomes an `Item`: its `custom_id` (the key that makes resume exactly-once), its input
position `line` (by which the finished output is ordered) and the request it carries, in the
OpenAI batch form (`custom_id`, `method`, `url`, `body`). A directory or a path list becomes the
same requests (a user message with the image and the task's prompt), so every input goes down one
path. A JSONL line is only split off and parsed as JSON here; what it asks for is checked when it
runs (`requests.py`). So a malformed line is one error row naming its line, never the end of the
job; so is a line repeating an earlier `custom_id` (its row gets the id `<line N>`, and the first
line keeps the id). Only an input that cannot be read at all stops the job before it starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.batch.spec import JobSpec

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

    def to_json(self) -> str:
        """The item as one JSON text (how the Ray engine hands items to its actors)."""
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Item:
        return cls(**json.loads(text))


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


def load_items(source: str | os.PathLike[str], spec: JobSpec) -> list[Item]:
    """Items of a directory (recursive, by image extension), a `.jsonl` file, or any other file
    read as a list of image paths (one per line; blank lines and `#` comments skipped)."""
    path = Path(source)
    if path.is_dir():
        items = _scan_directory(path, spec)
        if not items:
            raise InputError(f"{path}: no image files (by extension: {', '.join(sorted(IMAGE_EXTENSIONS))})")
    elif path.is_file():
        items = _read_jsonl(path) if path.suffix.lower() == ".jsonl" else _read_path_list(path, spec)
        if not items:
            raise InputError(f"{path}: no inputs in the file")
    else:
        raise InputError(f"{path}: no such file or directory")
    return _unique(items)


def _unique(items: list[Item]) -> list[Item]:
    """Give a line without an id one of its own (`<line N>`); a repeated custom_id makes that line
    an error row under such an id."""
    first: dict[str, int] = {}
    out = []
    for item in items:
        if not item.custom_id:
            item = dataclasses.replace(item, custom_id=_line_id(item.line, first))
        elif item.custom_id in first:
            problem = (f"custom_id {item.custom_id!r} is already the id of line {first[item.custom_id]}; ids must be "
                       "unique (this row's id is its line)")
            item = dataclasses.replace(item, custom_id=_line_id(item.line, first), request=None, problem=problem)
        first[item.custom_id] = item.line
        out.append(item)
    return out


def _line_id(line: int, taken: dict[str, int]) -> str:
    """The id of a line that has none of its own (unique even if a real id looks like it)."""
    custom_id = f"<line {line}>"
    while custom_id in taken:
        custom_id += "'"
    return custom_id


def _scan_directory(root: Path, spec: JobSpec) -> list[Item]:
    paths: list[Path] = []
    # Symlinked directories are not followed (no cycles); symlinked files are read like files.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        paths += [Path(dirpath) / name for name in sorted(filenames) if Path(name).suffix.lower() in IMAGE_EXTENSIONS]
    ids = sorted((full.relative_to(root).as_posix(), full) for full in paths)  # the listing's order: by custom_id
    return [Item(custom_id, position, image_request(custom_id, os.path.abspath(full), spec), numbered=False)
            for position, (custom_id, full) in enumerate(ids, 1)]


def _read_path_list(path: Path, spec: JobSpec) -> list[Item]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); is it an image? "
                         "Give a directory, a .jsonl file or a list of paths") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    base = path.parent
    items = []
    for lineno, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        full = Path(line) if Path(line).is_absolute() else base / line
        try:
            custom_id = full.relative_to(base).as_posix()
        except ValueError:
            custom_id = Path(line).as_posix()
        items.append(Item(custom_id, lineno, image_request(custom_id, os.path.abspath(full), spec)))
    return items


def _read_jsonl(path: Path) -> list[Item]:
    """Split on b"\\n" only (a JSON string may hold U+2028 and other characters `str.splitlines`
    would cut at); blank lines are skipped, as vLLM's `run_batch` skips them."""
    items = []
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if raw.strip():
                    items.append(_jsonl_item(raw, lineno))
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    return items


def _jsonl_item(raw: bytes, lineno: int) -> Item:
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return Item("", lineno, None, f"not UTF-8 text ({e.reason} at byte {e.start})")
    except json.JSONDecodeError as e:
        return Item("", lineno, None, f"not valid JSON: {e.msg} (column {e.colno})")
    if not isinstance(row, dict):
        return Item("", lineno, None,
                    f"a line must be a JSON object (custom_id, method, url, body), got {type(row).__name__}")
    custom_id = row.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Item("", lineno, None, f"custom_id must be a non-empty string, got {custom_id!r}")
    return Item(custom_id, lineno, row)
