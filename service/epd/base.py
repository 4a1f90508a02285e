"""The one protocol of an encoder-disaggregation transport: an encoding in; its delivery, and what
the consumer's side needs to find it, out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from service.engine import Encoding, Engine


@dataclass(frozen=True)
class Delivery:
    transfer_params: dict[str, Any]  # what the reply carries for the consumer (vLLM's ec_transfer_params)
    locations: list[str]  # where each item went (a file; a host:port), in the request's order
    keys: list[str] = field(default_factory=list)  # what the consumer finds each item by, where it has keys


class Sink(ABC):
    """Where encodings go: another engine's prefill. `destination` is what the transport's route
    said (None where the sink alone knows: a directory)."""

    @abstractmethod
    async def deliver(self, engine: Engine, encoding: Encoding, destination: Any = None) -> Delivery: ...

    @property
    def busy(self) -> bool:
        """Whether deliveries are still under way that a drain waits for (pushes in flight)."""
        return False

    def close(self) -> None:  # noqa: B027 - a sink that holds nothing has nothing to close
        """Once the server stopped serving: what the sink holds (sockets)."""
