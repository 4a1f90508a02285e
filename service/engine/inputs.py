"""What a request asks of the engine, checked once and prepared once.

Every face turns its wire form into these types at its edge (`MediaInput`, `ChatInput`,
`SamplingParams`), then takes two steps, whatever the face:

1. `Preparer.check` (`Engine.check`): the cheap rules, before any media byte is read (a face that
   fetches remote media calls it before fetching): the media count, each item's modality, the chat's
   media parts against its items, and the sampling values against this server's limits (n against
   the batch, `max_tokens` against the model length). It returns a `Checked`, the only thing the
   next step takes.
2. `Preparer.prepare` (`Engine.prepare`, off the event loop): each item's header is read once (its
   plan: sizes, token count, prompt) and its content key made; the request's pixels are bounded
   together; for a chat, the prompt is rendered and tokenized once, each media_pad expanded to its
   item's count (one `Prompt`, whatever the caller: generate, encode, count); `max_new_tokens` is
   resolved against the model length, and the request's prompts and longest sequence checked
   against the KV cache pool (what could never be admitted or finished). The result, `Prepared`,
   is what the engine's calls start from: below it nothing is checked again (the scheduler asserts).

A completion (`Preparer.prepare_text`) has no chat and no media: its prompt is text, tokenized
as a Hugging Face tokenizer of the checkpoint reads text (control-token spellings become their
ids), or token ids; its reply is plain text, not an assistant turn (`Prompt.turn`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from service.engine.identity import content_hash
from service.errors import BadRequest, NotConfigured, TooLarge, Unsupported
from service.metrics import Metrics
from textcore.chat import ChatError, check_chat_kwargs, render
from textcore.generate import SamplingParams
from textcore.splice import Span, expand_media_pads
from textcore.tokenizer import MEDIA_PAD_ID, NUM_BASE_TOKENS, Tokenizer
from vision.decode import Limits
from vision.errors import ImageError
from vision.media import Modality, check_modality, plan_media, preprocess_media
from vision.options import DEFAULT_OPTIONS, ImageOptions
from vision.preprocess import ImagePlan, Preprocessed

if TYPE_CHECKING:
    from service.engine.scheduler import Scheduler


@dataclass(frozen=True)
class MediaInput:
    """One media item of a request, its bytes read."""

    data: bytes
    modality: Modality = Modality.IMAGE
    options: ImageOptions = DEFAULT_OPTIONS
    where: str = ""  # where the request holds it ("messages[0].content[1]"), prefixed to its errors
    uuid: str | None = None  # a client's own id for the item (`service.media.item_uuid`): vLLM's key for it
    url: str | None = None  # the URL it came by, if any (vLLM's EPD proxy keys an item by its sha256)


ImageInput = MediaInput  # an image: the media item of the default modality


@dataclass(frozen=True)
class ChatInput:
    """A chat in the template's form: each media part is `{"type": "image"}` (the request's media
    items, in the order the template meets them, travel beside it)."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_chat_kwargs(self.kwargs)

    @property
    def media_parts(self) -> int:
        return sum(isinstance(part, dict) and part.get("type") == "image" for message in self.messages
                   if isinstance(message.get("content"), list) for part in message["content"])


class HasModality(Protocol):
    """What `check` reads of an item before its bytes are there (a `MediaInput`, or a face's reference)."""

    modality: Modality
    where: str


@dataclass(frozen=True)
class Checked:
    """A request that passed `Preparer.check`: how many media items it holds, its sampling."""

    media: int
    params: SamplingParams | None = None  # a generation's (max_new_tokens None: what the prompt leaves)


@dataclass(frozen=True)
class PlannedMedia:
    item: MediaInput
    plan: ImagePlan  # from the header alone: sizes, grid, token count, prompt
    key: str  # the content hash: the embedding cache's key


@dataclass(frozen=True)
class Prompt:
    """A chat's prompt for the trunk (or another engine's prefill): the ids with each media_pad
    expanded to its item's token count, where each item sits, and whether the generation prompt
    opens a think element (the output parser starts inside it)."""

    ids: list[int]
    spans: list[Span]
    thinking: bool
    turn: bool = True  # the reply is an assistant turn (parsed); False: plain text, a completion's

    @property
    def media_tokens(self) -> int:
        return sum(span.length for span in self.spans)


@dataclass(frozen=True)
class Prepared:
    media: list[PlannedMedia]
    prompt: Prompt | None = None  # with a chat
    params: SamplingParams | None = None  # with a generation: max_new_tokens resolved

    @property
    def media_tokens(self) -> list[int]:
        return [planned.plan.num_tokens for planned in self.media]


@contextlib.contextmanager
def named_refusal(item: MediaInput, metrics: Metrics) -> Iterator[None]:
    """Count a refused item by its kind, and prefix its error with where the request holds it (same
    error class): the one place for both, whether its header (planning) or its pixels (a worker)
    refused it."""
    try:
        yield
    except ImageError as exc:
        metrics.images_refused.labels(reason=exc.kind).inc()
        if not item.where:
            raise
        raise type(exc)(f"{item.where}: {exc}") from None


@dataclass(frozen=True)
class RequestLimits:
    """What one request may hold (`EngineConfig`'s caps, the model length the trunk allows)."""

    image: Limits  # per item
    max_media: int
    max_request_pixels: int
    max_model_len: int | None  # None without a trunk: nothing is generated


class Preparer:
    """The two steps of the module docstring, for one engine's tokenizer, limits and scheduler."""

    def __init__(self, tokenizer: Tokenizer, limits: RequestLimits, fingerprint: str, metrics: Metrics,
                 scheduler: Scheduler | None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.fingerprint = fingerprint
        self.metrics = metrics
        self.scheduler = scheduler

    def check(self, media: Sequence[HasModality], chat: ChatInput | None = None,
              params: SamplingParams | None = None) -> Checked:
        limits = self.limits
        if len(media) > limits.max_media:
            raise TooLarge(f"too many images: {len(media)}; this server takes at most {limits.max_media} per request")
        for item in media:
            check_modality(item.modality, item.where)
        if chat is not None and chat.media_parts != len(media):
            raise ChatError(f"the chat has {chat.media_parts} image parts but {len(media)} images were given")
        if params is not None:
            if self.scheduler is None:
                raise NotConfigured("this server runs the vision components only (components=vision): generation "
                                    "needs the trunk; serve with --components all")
            if chat is not None and chat.kwargs.get("add_generation_prompt") is False:
                raise BadRequest("generation always adds the generation prompt; drop add_generation_prompt")
            asked = params.max_new_tokens
            if asked is not None and asked >= limits.max_model_len:
                raise BadRequest(self._too_long(asked, None))
            self.scheduler.check_sequences(params)
        return Checked(len(media), params)

    def prepare(self, checked: Checked, media: Sequence[MediaInput], chat: ChatInput | None = None) -> Prepared:
        """Blocking (header reads, hashing, rendering): run it off the event loop."""
        assert len(media) == checked.media, "prepare takes the media that were checked"
        planned = [PlannedMedia(item, self._plan(item), content_hash(item.data, item.options, self.fingerprint))
                   for item in media]
        pixels = sum(w * h for w, h in (p.plan.orig_size for p in planned))
        if pixels > self.limits.max_request_pixels:
            raise TooLarge(f"the request's images hold {pixels} pixels; the limit is {self.limits.max_request_pixels}")
        if chat is None:
            return Prepared(planned)
        prompt = self._prompt(chat, [p.plan for p in planned])
        params = checked.params
        if params is not None:
            params = self._resolve_new_tokens(params, len(prompt.ids))
            self.scheduler.check(len(prompt.ids), params)
        return Prepared(planned, prompt, params)

    def prepare_text(self, checked: Checked, prompt: str | Sequence[int], where: str) -> Prepared:
        """A completion's prompt (text or token ids; `where` names it in errors), counted and its
        sampling resolved as `prepare` does a chat's. Blocking (tokenizing)."""
        assert checked.media == 0 and checked.params is not None, "prepare a checked completion"
        ids = self.text_ids(prompt) if isinstance(prompt, str) else self.check_ids(prompt, where)
        if MEDIA_PAD_ID in ids:
            raise Unsupported(f"{where} holds <|media_pad|> (id {MEDIA_PAD_ID}), an image's place: images are a chat "
                              "feature; send them as image_url parts to /v1/chat/completions")
        if not ids:
            raise BadRequest(f"{where} is empty: a completion continues at least one token")
        params = self._resolve_new_tokens(checked.params, len(ids))
        self.scheduler.check(len(ids), params)
        return Prepared([], Prompt(list(ids), [], thinking=False, turn=False), params)

    def text_ids(self, text: str) -> list[int]:
        """`text`'s ids as the checkpoint's Hugging Face tokenizer gives them (control-token
        spellings become their ids; nothing is added around them: this tokenizer adds no BOS)."""
        return self.tokenizer.encode(text, allow_special=True)

    def check_ids(self, ids: Sequence[int], where: str) -> list[int]:
        """`ids`, each in this tokenizer's vocabulary (the base tokens, then the reserved specials)."""
        base = self.tokenizer.num_base_tokens
        for i, token_id in enumerate(ids):
            if not (0 <= token_id < base or NUM_BASE_TOKENS <= token_id < self.tokenizer.vocab_size):
                raise BadRequest(f"{where}[{i}] is {token_id}, not a token id of this vocabulary (0..{base - 1} and "
                                 f"{NUM_BASE_TOKENS}..{self.tokenizer.vocab_size - 1})")
        return list(ids)

    def preprocess(self, item: MediaInput) -> Preprocessed:
        """The item's exact model input (blocking)."""
        with named_refusal(item, self.metrics):
            return preprocess_media(item.modality, item.data, item.options, self.limits.image)

    def _plan(self, item: MediaInput) -> ImagePlan:
        with named_refusal(item, self.metrics):
            return plan_media(item.modality, item.data, item.options, self.limits.image)

    def _prompt(self, chat: ChatInput, plans: Sequence[ImagePlan]) -> Prompt:
        """The chat rendered and tokenized once, each media_pad expanded to its item's token count."""
        segments = render(chat.messages, chat.tools, image_prompts=[plan.prompt for plan in plans], **chat.kwargs)
        # The generation prompt ends `<|open|>think<|sep|>` or `<|open|>response<|sep|>`.
        thinking = len(segments) >= 2 and segments[-2].text == "think"
        expanded = expand_media_pads(self.tokenizer.encode_segments(segments), [plan.num_tokens for plan in plans],
                                     MEDIA_PAD_ID)
        return Prompt(expanded.input_ids, expanded.spans, thinking)

    def _resolve_new_tokens(self, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
        """`params` with its new tokens within the model length after the prompt (absent: all the
        room left), or the refusal."""
        limit = self.limits.max_model_len
        if prompt_tokens >= limit:
            raise BadRequest(self._too_long(None, prompt_tokens))
        if params.max_new_tokens is None:
            return dataclasses.replace(params, max_new_tokens=limit - prompt_tokens)
        if prompt_tokens + params.max_new_tokens > limit:
            raise BadRequest(self._too_long(params.max_new_tokens, prompt_tokens))
        return params

    def _too_long(self, asked: int | None, prompt: int | None) -> str:
        """vLLM's words for a request over the model length (`prompt` None: not counted yet, at
        least one token)."""
        limit = self.limits.max_model_len
        if asked is None:
            return (f"This model's maximum context length is {limit} tokens. However, your request has {prompt} "
                    "input tokens. Please reduce the length of the input messages.")
        has = f"{prompt} input tokens ({asked} > {limit} - {prompt})" if prompt is not None else (
            f"at least 1 input token ({asked} > {limit} - 1)")
        return (f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum context "
                f"length is {limit} tokens and your request has {has}.")
