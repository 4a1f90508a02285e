"""vLLM's shared-storage encoder-cache transport, from the producer's side: what a producer's
request may name an entry by, and what its reply tells the proxy (`VllmStorageSink`). The files,
their keys and the rules that keep them trustworthy are the store's (`service.engine.store`): the
same directory a fleet of encoders shares.

Whoever can reach the producer names keys, so an entry is shared by every client: what keeps one
client from replacing or pre-seeding the embeddings another's request will load (docs/EPD.md, "Who
may name an entry"):

- An entry is never replaced (`write_ec`): a later writer of the same key with the same image gets
  the key as usual, one with another image a 400 (under a uuid a client chose, that is the only way
  two images meet one key).
- A uuid with the form of a content hash (`service.media.hash_shaped`) must be the item's own: its
  `mm_hash`, or the sha256 of the URL it came by (the key vLLM's EPD proxy sets on every image).
  Any other is a 400, so no request can take the key another image is, or will be, filed under.
- `client_uuids="content"` (`--ec-client-uuids content`) takes only such content keys: a uuid a
  client names freely (`user-item-42`) is then a 400, and every entry is bound to its image.

An encoder also reports, in its chat response, what the proxy needs to reference each image instead
of sending it (`transfer_params`: vLLM's `collect_ec_item_metadata`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from service.engine import Encoding, Engine, MediaInput
from service.engine.store import STORE_DTYPE, ItemKey, hash_shaped, item_keys, write_ec
from service.epd.base import Delivery, Sink
from service.errors import BadRequest, NotConfigured
from vision.media import Modality


class HasUuid(Protocol):
    """What `VllmStorageSink.check` reads of an item before its bytes are there (a face's reference)."""

    uuid: str | None
    where: str


def transfer_params(keys: Sequence[str], modalities: Sequence[Modality],
                    grids: Sequence[tuple[int, int, int]]) -> dict[str, dict[str, Any]]:
    """A producer's `ec_transfer_params`, in vLLM's schema (`collect_ec_item_metadata`,
    vllm/distributed/ec_transfer/ec_connector/utils.py): per key, in first-seen order, the item's
    modality, the positions of the request's items filed under it (`item_indices`), and the
    placeholder metadata, K3's `grid_thws` of the item ([t, h, w] patches: h * w / 4 tokens), which
    vLLM's proxy turns into an `image_embeds` reference for the decoder."""
    params: dict[str, dict[str, Any]] = {}
    for index, (key, modality, grid) in enumerate(zip(keys, modalities, grids, strict=True)):
        entry = params.setdefault(key, {"modality": modality.value, "item_indices": []})
        entry["metadata"] = {"grid_thws": list(grid)}
        entry["item_indices"].append(index)
    return params


@dataclass(frozen=True)
class VllmStorageSink(Sink):
    """Each item's rows, in the store's dtype (vLLM's activation dtype for K3, bf16), written under
    `directory` by the key vLLM computes for it; the delivery's transfer params are vLLM's.
    `client_uuids`: "accept" any uuid under the module's rules, or take "content" keys only."""

    directory: Path
    model_id: str
    algorithm: str
    checkpoint: str  # the engine's fingerprint, recorded in each file (the store's hits are its own)
    client_uuids: str = "accept"

    @classmethod
    def of(cls, engine: Engine) -> VllmStorageSink:
        """The engine's export directory (`--ec-export-dir`), model id, hash algorithm and uuid rule."""
        config = engine.config
        if config.ec_export_dir is None:
            raise NotConfigured("exporting vLLM encoder-cache files needs the server to run with --ec-export-dir")
        return cls(Path(config.ec_export_dir), engine.model_id, config.hash_algorithm, engine.fingerprint,
                   config.ec_client_uuids)

    def check(self, items: Sequence[HasUuid]) -> None:
        """Before the items' bytes are read: with content keys only, a uuid that cannot be one."""
        if self.client_uuids != "content":
            return
        for item in items:
            if item.uuid is not None and not hash_shaped(item.uuid):
                raise BadRequest(f"{item.where or 'image'}: uuid {item.uuid!r} is refused: this server takes as "
                                 "uuid only an item's own content key (its vLLM mm_hash, or the sha256 of its URL, "
                                 "as vLLM's EPD proxy sets); --ec-client-uuids content")

    def keys(self, media: Sequence[MediaInput]) -> list[ItemKey]:
        """Each item's key, every rule checked (blocking: run it off the event loop, before encoding)."""
        self.check(media)
        return item_keys(media, self.model_id, self.algorithm)

    def write(self, encoding: Encoding, keys: Sequence[ItemKey]) -> Delivery:
        """Blocking: run it off the event loop (`Engine.run_cpu`)."""
        paths = [str(write_ec(self.directory, k.key, e.rows.to(STORE_DTYPE), k.image, item.where or "image",
                              self.checkpoint))
                 for k, e, item in zip(keys, encoding.embeddings, encoding.media, strict=True)]
        params = transfer_params([k.key for k in keys], [item.modality for item in encoding.media],
                                 [e.grid_thw for e in encoding.embeddings])
        return Delivery(params, paths, [k.key for k in keys])

    async def deliver(self, engine: Engine, encoding: Encoding, destination: Sequence[ItemKey]) -> Delivery:
        """`destination`: the items' keys, from `keys` (before the encoding)."""
        return await engine.run_cpu(self.write, encoding, destination)
