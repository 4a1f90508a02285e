"""The engine: the one transport-free road from image bytes to rows, counts, prompts, encodings
and generations (`engine.py`), with the encoder pool and its worker processes, the embedding
cache, the model identity and the vLLM encoder-cache export it uses."""

from service.engine.engine import (
    ChatInput,
    ChatTokens,
    Encoding,
    Engine,
    EngineConfig,
    GenerationResult,
    ImageEmbedding,
    ImageInput,
    SamplingParams,
)

__all__ = ["ChatInput", "ChatTokens", "Encoding", "Engine", "EngineConfig", "GenerationResult", "ImageEmbedding",
           "ImageInput", "SamplingParams"]
