"""Output processing beside the trunk: from sampled token ids to what a caller hears.

The trunk's thread samples each sequence's token and decides the finishes that need no text (a
stop token, the length); everything that reads text runs here, on a thread of its own
(`OutputProcessor`), so a decode step never waits for the replies' text: the tokenizer's decode
and the K3 output parser (`textcore.parser.StreamParser`), the stop strings
(`textcore.stops.StopStrings`), the `Logprobs` and `Choice` items and the generation's end. A stop
string found here finishes the reply at once (its `GenerationResult` is emitted here) and marks
the sequence `stopped`; the trunk drops it at its next step, as it drops one whose caller left,
and the tokens it sampled meanwhile are never reported.

Items reach this thread in the order the trunk put them, so each reply's tokens, its result and
its generation's end keep their order.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from textcore.generate import Sample
from textcore.parser import Event, StreamParser, TextDecoder, output_parser
from textcore.stops import StopStrings
from textcore.tokenizer import END_OF_MSG_ID, Tokenizer

if TYPE_CHECKING:
    from service.engine.scheduler import Generation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationResult:
    """The last item of each choice of `Engine.generate`."""

    finish_reason: str  # "stop" | "length"
    prompt_tokens: int  # after expansion
    image_tokens: int
    completion_tokens: int
    stop_reason: int | str | None = None  # what stopped it: a stop_token_ids id, a stop string (vLLM's)


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float


@dataclass(frozen=True)
class Logprobs:
    """One sampled token's log-probability and the most likely tokens at its position, by id. Their
    text is read by the face that reports them (`text`)."""

    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...]
    token_bytes: Callable[[int], bytes]  # a token's exact bytes (the tokenizer's)

    def text(self, entry: TokenLogprob) -> tuple[str, bytes]:
        """`entry`'s text (a character cut in half by the tokenizer shows as U+FFFD) and its exact bytes."""
        data = self.token_bytes(entry.token_id)
        return data.decode("utf-8", errors="replace"), data


class Choice(NamedTuple):
    """An item of `Engine.generate`: which of the request's n replies (0-based) and what: a parser
    event, a token's `Logprobs` (before the events of its text), or the reply's `GenerationResult`."""

    index: int
    item: Event | Logprobs | GenerationResult


@dataclass
class Reply:
    """One sequence's output side: its parser, stop strings and output tokens so far. Made on the
    trunk's thread when the sequence starts, used only on the output thread after; `stopped` is
    the one field the trunk reads (a stop string ended the reply: drop the sequence)."""

    job: Generation
    index: int
    tokenizer: Tokenizer
    parser: StreamParser | TextDecoder = field(init=False)
    stops: StopStrings = field(init=False)
    tokens: int = 0
    done: bool = False
    stopped: bool = False

    def __post_init__(self) -> None:
        params = self.job.params
        self.parser = output_parser(self.tokenizer, turn=self.job.prompt.turn, thinking=self.job.prompt.thinking,
                                    skip_special_tokens=params.skip_special_tokens,
                                    spaces_between_special_tokens=params.spaces_between_special_tokens)
        self.stops = StopStrings(params.stop, include=params.include_stop_str_in_output)

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.decode_bytes([token_id])

    def feed(self, sample: Sample, reason: str | None) -> None:
        """The sequence's sampled token and the trunk's finish reason for it (None: it goes on):
        report it (logprobs, then the text it completes) and finish the reply at a stop token, a
        stop string or its length."""
        stop_reason: int | str | None = None
        if reason == "stop" and sample.token_id != END_OF_MSG_ID:
            stop_reason = sample.token_id
        if reason == "stop":  # a stop token is not part of the reply; <|end_of_msg|> ends the parser's turn
            events = self.parser.feed([END_OF_MSG_ID]) if sample.token_id == END_OF_MSG_ID else []
        else:
            self.tokens += 1
            if sample.logprobs is not None:
                raw = sample.logprobs
                self._emit(Logprobs(TokenLogprob(raw.token_id, raw.logprob), tuple(map(TokenLogprob._make, raw.top)),
                                    self.token_bytes))
            events = self.parser.feed([sample.token_id])
        released = self.stops.feed(events, search=self.tokens > self.job.params.min_tokens)
        if self.stops.matched is not None:
            reason, stop_reason, self.stopped = "stop", self.stops.matched, True
        elif reason is not None:
            released += self.stops.feed(self.parser.close())
            released += self.stops.flush()
        for event in released:
            self._emit(event)
        if reason is not None:
            prompt = self.job.prompt
            self._emit(GenerationResult(reason, len(prompt.ids), prompt.media_tokens, self.tokens, stop_reason))
            self.done = True
            self.job.open -= 1
            if self.job.open == 0:
                self.job.end()

    def _emit(self, item: Event | Logprobs | GenerationResult) -> None:
        self.job.emit(Choice(self.index, item))


class OutputProcessor:
    """Runs `Reply.feed` and generations' ends in the order they are put: on a thread of its own,
    or (`threaded=False`) at once on the caller's, the trunk's (the comparison `bench.serving step`
    measures)."""

    def __init__(self, *, threaded: bool = True) -> None:
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="kimi-vision-output", daemon=True) if threaded else None
        if self._thread is not None:
            self._thread.start()

    def tokens(self, taken: list[tuple[Reply, Sample, str | None]]) -> None:
        """One step's sampled tokens, each with its reply and the trunk's finish reason (one hand-over a step)."""
        if taken:
            self._put(("tokens", taken))

    def end(self, job: Generation, exc: BaseException) -> None:
        """End `job` with `exc` after the items put before."""
        self._put(("end", (job, exc)))

    def close(self) -> None:
        """Run what was put, then stop."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()

    def _put(self, work: tuple) -> None:
        if self._thread is None:
            self._run(work)
        else:
            self._queue.put(work)

    def _loop(self) -> None:
        while (work := self._queue.get()) is not None:
            self._run(work)

    @staticmethod
    def _run(work: tuple) -> None:
        kind, what = work
        if kind == "end":
            job, exc = what
            try:
                job.end(exc)
            except Exception:  # noqa: BLE001 - a caller that cannot hear its end: the others still hear theirs
                log.exception("ending a generation failed")
            return
        for reply, sample, reason in what:
            job = reply.job
            if reply.done or job.ended or job.cancelled.is_set():
                continue
            try:
                reply.feed(sample, reason)
            except Exception as exc:  # noqa: BLE001 - this job's caller (its emit) failed; the others go on
                log.exception("output processing failed")
                job.dropped = True  # the trunk drops its sequences at its next step
                with contextlib.suppress(Exception):  # its emit may fail at the end too
                    job.end(exc)
