"""A request's media as its face names them, before their bytes are read, and the one rule for an
image part that every face applies (a chat's `image_url` part, an `/encode` item, a batch line; the
gRPC `Image` message holds the same fields).

An image is `{"url": ..., "detail": ...}` (or the URL alone). `detail` is OpenAI's field
("auto", "low", "high"): accepted and without effect, since Kimi-K3's processor has one way to
preprocess an image (docs/MODEL.md §4). Any other field is refused by name: it would ask for
preprocessing this encoder does not do, and an ignored option would give rows the client did not
ask for.

An item's `uuid` (vLLM's field: the client's own id for it) names a directory in a vLLM
encoder-cache store (`service.engine.store`), so one rule, `UUID_RULE` there, says what a uuid may
be, and every face checks it where the uuid enters (`item_uuid`), before any byte is fetched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.engine.inputs import MediaInput
from service.engine.store import UUID_RULE, is_key
from service.errors import BadRequest, Unsupported
from vision.media import Modality
from vision.options import DEFAULT_OPTIONS, ImageOptions

IMAGE_FIELDS = ("url", "detail")
DETAILS = ("auto", "low", "high")
def item_uuid(value: Any, where: str) -> str | None:
    """A media item's `uuid` as a face received it (None: absent), checked against `UUID_RULE`."""
    if value is None:
        return None
    if not isinstance(value, str) or not is_key(value):
        shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:60]}... ({len(value):,} characters)"
        raise BadRequest(f"{where}: uuid must be {UUID_RULE}, got {shown}")
    return value


@dataclass(frozen=True)
class MediaRef:
    """Where one media item's bytes are (a `data:` URL, an http(s) URL, a path), and what the
    request says of it."""

    url: str
    where: str  # "messages[0].content[1]"
    modality: Modality = Modality.IMAGE
    uuid: str | None = None  # a client's own item id, `item_uuid` checked (vLLM keys the item by it)
    options: ImageOptions = DEFAULT_OPTIONS

    def input(self, data: bytes) -> MediaInput:
        """The item, its bytes read."""
        return MediaInput(data, self.modality, self.options, self.where, self.uuid, self.url)


def check_detail(detail: Any, where: str) -> None:
    """OpenAI's `detail`: one of `DETAILS`, or absent (empty or null)."""
    if detail not in (None, "", *DETAILS):
        raise BadRequest(f"{where}: detail must be one of {list(DETAILS)}, got {detail!r}")


def image_url(spec: Any, where: str, *, item_ids: tuple[str, ...] = ()) -> str:
    """The URL of an image given as a URL string or `{"url", "detail"}`; `item_ids`: the fields
    a face's wire adds to name the item (SGLang's `content_hash`), accepted beside them."""
    if isinstance(spec, Mapping):
        unknown = sorted(key for key in set(spec) - {*IMAGE_FIELDS, *item_ids} if spec[key] is not None)
        if unknown:
            raise Unsupported(f"{where}: {unknown} are not supported; an image is {{'url': ..., 'detail': ...}} "
                              "(this encoder preprocesses every image as Kimi-K3's release processor does)")
        check_detail(spec.get("detail"), where)
        spec = spec.get("url")
    if not isinstance(spec, str) or not spec:
        raise BadRequest(f"{where}: an image's url must be a non-empty string")
    return spec
