"""The engine: the one transport-free road from image bytes to rows, counts, prompts, encodings
and generations (`engine.py`), with the trunk's scheduler (continuous batching), the encoder pool
and its worker processes, the embedding cache, the model identity and the vLLM encoder-cache
export it uses."""

from service.engine.engine import (
    ChatInput,
    ChatTokens,
    Encoding,
    Engine,
    EngineConfig,
    ImageEmbedding,
    ImageInput,
    SamplingParams,
)
from service.engine.scheduler import Choice, GenerationResult, Logprobs, TokenLogprob

__all__ = ["ChatInput", "ChatTokens", "Choice", "Encoding", "Engine", "EngineConfig", "GenerationResult",
           "ImageEmbedding", "ImageInput", "Logprobs", "SamplingParams", "TokenLogprob"]
