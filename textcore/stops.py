"""Stop strings: a reply ends where one of them first appears in its text, and the matched text
(and everything after it) is not part of the reply, as OpenAI and vLLM do; with `include` (vLLM's
`include_stop_str_in_output`) the matched text ends the reply instead.

The text is what the parser streams (`textcore.parser`: reasoning, content and tool-argument
deltas, control tokens being structure, not text). Like vLLM, the filter holds back the last
`len(longest stop) - 1` characters (they could be the start of a match), searches only where a match
could end in the newest text, takes the stop strings in their given order, and does not search the
text of the first `min_tokens` tokens (the caller says when: `search=False`). Events without text
(a tool call opening, a protocol error) keep their place among the text events.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from textcore.parser import ContentDelta, Event, ReasoningDelta, ToolArgumentDelta

TEXT_EVENTS = (ReasoningDelta, ContentDelta, ToolArgumentDelta)


def _text(event: Event) -> str:
    return event.text if isinstance(event, TEXT_EVENTS) else ""


class StopStrings:
    """One reply's stop-string filter over its parser events."""

    def __init__(self, stop: Sequence[str], include: bool = False):
        self.stop = tuple(stop)
        self.include = include
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._pending: list[Event] = []
        self.matched: str | None = None  # the stop string that ended the reply

    def feed(self, events: Iterable[Event], search: bool = True) -> list[Event]:
        """Take the events of one token; return those now known to be part of the reply. After a
        match (`matched` set) everything after it is dropped (the match too, unless `include`); feed
        no more."""
        events = list(events)
        if not self.stop:
            return events
        new = sum(len(_text(e)) for e in events)
        self._pending.extend(events)
        text = "".join(_text(e) for e in self._pending)
        if search:
            for stop in self.stop:
                at = text.find(stop, max(0, len(text) - new - len(stop) + 1))
                if at != -1:
                    self.matched = stop
                    released = self._release(at + len(stop) if self.include else at)
                    self._pending = []
                    return released
        return self._release(len(text) - self._hold)

    def flush(self) -> list[Event]:
        """The end of the reply: everything held back is part of it."""
        events, self._pending = self._pending, []
        return events

    def _release(self, upto: int) -> list[Event]:
        """The pending events whose text lies before character `upto` (a text event across it is
        split); events without text go with the text before them."""
        out: list[Event] = []
        seen = 0
        for k, event in enumerate(self._pending):
            text = _text(event)
            if seen + len(text) <= upto:
                out.append(event)
                seen += len(text)
                continue
            if upto > seen:
                cut = upto - seen
                out.append(dataclasses.replace(event, text=text[:cut]))
                self._pending = [dataclasses.replace(event, text=text[cut:]), *self._pending[k + 1:]]
            else:
                self._pending = self._pending[k:]
            return out
        self._pending = []
        return out
