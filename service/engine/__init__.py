"""The engine: the one transport-free road from media bytes to rows, prompts, encodings and
generations (`engine.py`); what a request becomes before it runs (`inputs.py`: checked, then
prepared once); how an engine is built (`config.py`, `loading.py`); the trunk's scheduler
(continuous batching), the encoder pool and its worker processes, the embedding cache and the
model identity it uses."""

from service.engine.config import EngineConfig
from service.engine.engine import Encoding, Engine, MediaEmbedding
from service.engine.inputs import ChatInput, Checked, ImageInput, MediaInput, Prepared, Prompt
from service.engine.scheduler import Choice, GenerationResult, Logprobs, TokenLogprob
from textcore.generate import SamplingParams

__all__ = ["ChatInput", "Checked", "Choice", "Encoding", "Engine", "EngineConfig", "GenerationResult", "ImageInput",
           "Logprobs", "MediaEmbedding", "MediaInput", "Prepared", "Prompt", "SamplingParams", "TokenLogprob"]
