"""Kimi-K3 tokenizer: the release's tiktoken BPE, special-token table and long-input chunking.

`Tokenizer.from_pretrained(dir)` reads `tiktoken.model` (base64 `<token> <rank>` lines, ranks
contiguous from 0) and `tokenizer_config.json` (its `added_tokens_decoder` names the reserved
specials 163,584..163,839; unnamed ones are `<|reserved_token_{id}|>`). The same code loads the
release files and the small vocabulary `textcore.tiny_vocab` writes, so token ids always line up
with a 163,840-row embedding.

Two behaviours are part of the wire format, not optimisations:
- the pre-tokenizer regex (`PAT_STR`, K2/K3's Han-aware split, which needs tiktoken's Rust
  regex engine for `&&` class intersection and `\\p{Han}`);
- the release cuts text into 400,000-char pieces and then cuts runs of more than 25,000
  whitespace (or non-whitespace) characters before handing each piece to tiktoken. The cuts
  change BPE merges, so they are reproduced exactly (see `split_for_encoding`).
"""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import tiktoken

NUM_BASE_TOKENS = 163_584
NUM_RESERVED_SPECIAL_TOKENS = 256
VOCAB_SIZE = NUM_BASE_TOKENS + NUM_RESERVED_SPECIAL_TOKENS  # 163,840

BOS_ID = 163_584
EOS_ID = 163_585  # nominal [EOS]; generation stops at END_OF_MSG_ID
END_OF_MSG_ID = 163_586
OPEN_ID = 163_587
CLOSE_ID = 163_588
SEP_ID = 163_589
MEDIA_BEGIN_ID = 163_602
MEDIA_CONTENT_ID = 163_603
MEDIA_END_ID = 163_604
MEDIA_PAD_ID = 163_605
UNK_ID = 163_838
PAD_ID = 163_839

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"

# The release's named specials: id -> (name, special flag). `special=False` marks tokens that
# are registered but not special (they survive `skip_special_tokens`). The tiny vocabulary writes
# this table; loading a directory checks the ids the project depends on against it.
NAMED_SPECIAL_TOKENS: dict[int, tuple[str, bool]] = {
    163_584: ("[BOS]", True),
    163_585: ("[EOS]", True),
    163_586: (END_OF_MSG, True),
    163_587: (OPEN, False),
    163_588: (CLOSE, False),
    163_589: (SEP, False),
    163_590: ("[start_header_id]", True),
    163_591: ("[end_header_id]", True),
    163_593: ("[EOT]", True),
    163_602: ("<|media_begin|>", True),
    163_603: ("<|media_content|>", True),
    163_604: ("<|media_end|>", True),
    163_605: ("<|media_pad|>", True),
    163_649: ("<osagent_mode>", True),
    163_838: ("[UNK]", True),
    163_839: ("[PAD]", True),
}
# The ids other modules hard-code; a tokenizer directory that names them differently is refused.
_REQUIRED_IDS = (BOS_ID, EOS_ID, END_OF_MSG_ID, OPEN_ID, CLOSE_ID, SEP_ID,
                 MEDIA_BEGIN_ID, MEDIA_CONTENT_ID, MEDIA_END_ID, MEDIA_PAD_ID)

# The K2/K3 pre-tokenizer, character for character as the release's tokenizer defines it.
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

MAX_ENCODE_CHARS = 400_000
MAX_CONSECUTIVE_CHARS = 25_000
_SHORT_SEGMENT_CHARS = 64
_SHORT_SEGMENT_CACHE = 8192


class TokenizerError(ValueError):
    """A tokenizer directory or an id sequence that cannot be used."""


class Segment(NamedTuple):
    """A piece of a rendered prompt; `special` says whether control-token spellings in it become ids."""

    text: str
    special: bool


def reserved_token_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def _long_run_pattern(max_run: int) -> re.Pattern[str]:
    # A lookbehind anchors each attempt at the start of a run, so the scan stays linear even for
    # long runs just under the limit. Python's `\s` and `str.isspace` share one definition.
    n = max_run + 1
    return re.compile(rf"(?<!\S)\S{{{n},}}|(?<!\s)\s{{{n},}}")


_LONG_RUN = _long_run_pattern(MAX_CONSECUTIVE_CHARS)


def _run_length_through(text: str, position: int, max_run: int) -> int:
    """Length of the whitespace / non-whitespace run holding `text[position]`, capped near 2 * max_run + 2."""
    left = text[max(0, position - max_run - 1):position]
    right = text[position:position + max_run + 1]
    if right[0].isspace():
        return (len(left) - len(left.rstrip())) + (len(right) - len(right.lstrip()))
    left_len = len(left.rsplit(None, 1)[-1]) if left and not left[-1].isspace() else 0
    return left_len + len(right.split(None, 1)[0])


def _has_long_run(text: str, max_run: int) -> bool:
    # A run longer than max_run covers a multiple of max_run, so probing those positions finds
    # every one; each probe is a few C-speed string operations (the common case never scans the
    # whole text in Python-level regex).
    return any(_run_length_through(text, p, max_run) > max_run for p in range(0, len(text), max_run))


def split_long_runs(text: str, max_run: int = MAX_CONSECUTIVE_CHARS) -> list[str]:
    """Cut `text` so that no piece holds more than `max_run` whitespace (or non-whitespace) chars in a row.

    Same cuts as the release: a run longer than `max_run` is cut every `max_run` characters from
    its start; text between long runs is left whole.
    """
    if len(text) <= max_run or not _has_long_run(text, max_run):
        return [text]
    pattern = _LONG_RUN if max_run == MAX_CONSECUTIVE_CHARS else _long_run_pattern(max_run)
    pieces: list[str] = []
    start = 0
    for run in pattern.finditer(text):
        for cut in range(run.start() + max_run, run.end(), max_run):
            pieces.append(text[start:cut])
            start = cut
    pieces.append(text[start:])
    return pieces


def split_for_encoding(text: str) -> Iterator[str]:
    """The pieces the release hands to tiktoken one at a time (400k-char chunks, then long-run cuts)."""
    for offset in range(0, len(text), MAX_ENCODE_CHARS):
        yield from split_long_runs(text[offset:offset + MAX_ENCODE_CHARS])


def load_ranks(path: Path) -> dict[bytes, int]:
    """Read a tiktoken BPE file, requiring ranks contiguous from 0."""
    ranks: dict[bytes, int] = {}
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"cannot read {path}: {exc.strerror or exc}") from None
    for line_no, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token_b64, rank_text = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank_text)
        except ValueError:
            raise TokenizerError(f"{path}:{line_no}: expected '<base64 token> <rank>'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be unique and contiguous from 0 ({len(ranks)} tokens)")
    if len(ranks) > NUM_BASE_TOKENS:
        raise TokenizerError(f"{path}: {len(ranks)} ranks overlap the reserved specials at {NUM_BASE_TOKENS}")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise TokenizerError(f"{path}: every single byte must have a rank, or some text cannot be encoded")
    return ranks


def load_special_tokens(path: Path) -> dict[int, tuple[str, bool]]:
    """The 256 reserved specials from `tokenizer_config.json`: id -> (name, special flag)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TokenizerError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from None
    decoder = config.get("added_tokens_decoder") if isinstance(config, dict) else None
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{path}: missing the 'added_tokens_decoder' table")
    table: dict[int, tuple[str, bool]] = {}
    for key, entry in decoder.items():
        try:
            token_id = int(key)
            name, special = entry["content"], bool(entry.get("special", True))
        except (ValueError, TypeError, KeyError):
            raise TokenizerError(f"{path}: added_tokens_decoder[{key!r}] needs an integer id and a 'content'") from None
        if not NUM_BASE_TOKENS <= token_id < VOCAB_SIZE:
            raise TokenizerError(f"{path}: added token id {token_id} is outside {NUM_BASE_TOKENS}..{VOCAB_SIZE - 1}")
        table[token_id] = (name, special)
    for token_id in _REQUIRED_IDS:
        expected = NAMED_SPECIAL_TOKENS[token_id]
        if table.get(token_id) != expected:
            raise TokenizerError(
                f"{path}: id {token_id} must be {expected[0]!r} (special={expected[1]}), found {table.get(token_id)}")
    return {i: table.get(i, (reserved_token_name(i), True)) for i in range(NUM_BASE_TOKENS, VOCAB_SIZE)}


class Tokenizer:
    """Encode and decode Kimi-K3 token ids exactly as the release does."""

    def __init__(self, ranks: dict[bytes, int], specials: dict[int, tuple[str, bool]], name: str = "kimi-k3"):
        self.num_base_tokens = len(ranks)
        self.vocab_size = VOCAB_SIZE
        self.special_names = {token_id: name for token_id, (name, _) in specials.items()}
        self.special_ids = {name: token_id for token_id, name in self.special_names.items()}
        # Registered-but-not-special ids (open/close/sep) survive skip_special_tokens.
        self.skippable_ids = frozenset(i for i, (_, special) in specials.items() if special)
        self._encoding = tiktoken.Encoding(
            name=name, pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=dict(self.special_ids))
        self._special_set = frozenset(self.special_ids)
        self._encode_short_cached = functools.lru_cache(maxsize=_SHORT_SEGMENT_CACHE)(self._encode_short_ordinary)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> Tokenizer:
        directory = Path(directory)
        if not directory.is_dir():
            raise TokenizerError(f"tokenizer directory {directory} does not exist")
        return cls(load_ranks(directory / "tiktoken.model"), load_special_tokens(directory / "tokenizer_config.json"),
                   name=directory.name or "kimi-k3")

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. Control-token spellings become their ids only when `allow_special`."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode needs a str, got {type(text).__name__}")
        encoding = self._encoding
        pieces = (text,) if len(text) <= MAX_CONSECUTIVE_CHARS else split_for_encoding(text)
        ids: list[int] = []
        for piece in pieces:
            if allow_special:
                ids.extend(encoding.encode(piece, allowed_special=self._special_set, disallowed_special=()))
            else:
                ids.extend(encoding.encode_ordinary(piece))
        return ids

    def _encode_short_ordinary(self, text: str) -> tuple[int, ...]:
        return tuple(self._encoding.encode_ordinary(text))

    def encode_segments(self, segments: Iterable[Segment | tuple[str, bool]]) -> list[int]:
        """Encode each segment on its own (BPE never merges across a segment boundary).

        A rendered chat is mostly tiny segments that repeat (markers, tag names, ` role`, `="`), so
        a marker maps straight to its id and short plain segments go through a bounded cache; the
        per-call overhead of tiktoken otherwise dominates.
        """
        ids: list[int] = []
        special_ids = self.special_ids
        short = self._encode_short_cached
        for text, special in segments:
            if special and text in special_ids:
                ids.append(special_ids[text])
            elif not special and len(text) <= _SHORT_SEGMENT_CHARS and isinstance(text, str):
                ids.extend(short(text))
            else:
                ids.extend(self.encode(text, allow_special=special))
        return ids

    def _check_ids(self, ids: Sequence[int]) -> None:
        base, size = self.num_base_tokens, self.vocab_size
        for token_id in ids:
            if not (0 <= token_id < base or NUM_BASE_TOKENS <= token_id < size):
                raise TokenizerError(f"token id {token_id} is not in this vocabulary "
                                     f"(0..{base - 1} and {NUM_BASE_TOKENS}..{size - 1})")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Raw bytes of `ids` (exact even when a multi-byte character is split across calls)."""
        self._check_ids(ids)
        return self._encoding.decode_bytes(list(ids))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a character cut in half) becomes U+FFFD.

        `skip_special_tokens` drops every reserved id flagged special, keeping the non-special
        markers `<|open|>`, `<|close|>` and `<|sep|>`.
        """
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.skippable_ids]
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_id(self, name: str) -> int:
        """Id of a special token by name, e.g. `<|media_pad|>`."""
        try:
            return self.special_ids[name]
        except KeyError:
            raise TokenizerError(f"{name!r} is not a special token of this tokenizer") from None
