"""What an engine is built with: one value, checked once. Every default here is the one the CLI
flags show (`service.cli.serve` reads them off this class)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from service.cpus import cpu_budget
from service.engine.allocator import KEEP_FREED_BYTES
from vision.decode import DEFAULT_LIMITS, Limits

Components = Literal["all", "vision"]
COMPONENTS = ("all", "vision")
DEFAULT_MODEL_ID = "moonshotai/Kimi-K3"  # what `vllm serve` is given for the release
HASH_ALGORITHMS = ("blake3", "sha256", "sha512")  # vLLM's --mm-hasher-algorithm (blake3 its default)
# Which item uuids the vLLM export takes (service.epd.vllm_storage): any under its rules, or only the
# item's own content key (its mm_hash, the sha256 of its URL).
CLIENT_UUIDS = ("accept", "content")


@dataclass(frozen=True)
class EngineConfig:
    checkpoint: str | os.PathLike[str]  # resolved by the caller (the CLI resolves the embedded default)
    devices: str = "auto"  # encoder pool: auto | cpu:N | cuda:0,1
    threads_per_worker: int | None = None  # torch/OpenCV threads per encoder worker (None: usable CPUs / workers)
    patchify: str = "auto"  # where encoder workers build the float patches: auto (GPU: device) | device | host
    components: Components = "all"  # "vision": tokenizer, tower and projector only; no trunk is loaded
    # The model id vLLM runs (`vllm serve MODEL`): it keys vLLM's mm_hash of every image, and names
    # the model to OpenAI clients. None: the checkpoint's `_name_or_path`, else DEFAULT_MODEL_ID.
    model_id: str | None = None
    served_model_names: tuple[str, ...] = ()  # names a request's `model` may give (default: the model id)
    hash_algorithm: str = "blake3"  # vLLM's --mm-hasher-algorithm: blake3 | sha256 | sha512
    limits: Limits = DEFAULT_LIMITS  # per image
    max_images: int = 16  # media items per request
    max_request_pixels: int = 200_000_000  # decoded pixels of all of a request's images together
    cache_bytes: int = 1 << 30
    ec_export_dir: str | os.PathLike[str] | None = None  # where vLLM encoder-cache files may be written
    ec_client_uuids: str = "accept"  # CLIENT_UUIDS: which item uuids may name an exported file
    # The export directory is also the fleet's store (service.engine.store): how long an instance's
    # claim on an item it encodes lives, the store's budget (None: unbounded) and the youngest age
    # an entry may be evicted at.
    ec_lease_seconds: float = 30.0
    ec_store_max_bytes: int | None = None
    ec_store_min_age_s: float = 300.0
    # cpu_executor's threads (default: the usable CPUs, service.cpus, at least 2)
    cpu_threads: int = field(default_factory=lambda: max(2, cpu_budget().usable))
    # Free memory each malloc arena keeps for the next image (service.engine.allocator), in this
    # process and in each encoder worker; 0 leaves their allocators as they are.
    keep_freed_bytes: int = KEEP_FREED_BYTES
    # Prompt plus generated tokens of one request, as vLLM's --max-model-len (None: the trunk's
    # max_position_embeddings, the checkpoint's context length).
    max_model_len: int | None = None
    # The trunk's scheduler (vLLM's names): sequences decoding together, tokens per engine step
    # (decode tokens plus prefill chunks), and the budget of the admitted generations' worst-case
    # caches (None: scheduler.KV_MEMORY_FRACTION of the trunk device's memory).
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    kv_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.components not in COMPONENTS:
            raise ValueError(f"components must be one of {COMPONENTS}, got {self.components!r}")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hash_algorithm must be one of {HASH_ALGORITHMS}, got {self.hash_algorithm!r}")
        if self.ec_client_uuids not in CLIENT_UUIDS:
            raise ValueError(f"ec_client_uuids must be one of {CLIENT_UUIDS}, got {self.ec_client_uuids!r}")
        for name in ("max_images", "max_request_pixels", "cpu_threads", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and a new one), got {self.max_model_len}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence takes a token of each step")
        if not self.ec_lease_seconds > 0:
            raise ValueError(f"ec_lease_seconds must be > 0, got {self.ec_lease_seconds}")
        if self.ec_store_max_bytes is not None and self.ec_store_max_bytes < 1:
            raise ValueError(f"ec_store_max_bytes must be >= 1, got {self.ec_store_max_bytes}")
        if not self.ec_store_min_age_s >= 0:
            raise ValueError(f"ec_store_min_age_s must be >= 0, got {self.ec_store_min_age_s}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
