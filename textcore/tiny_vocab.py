"""A small tiktoken vocabulary the project generates itself, with the release's special-token ids.

The tiny checkpoint cannot ship the release vocabulary, yet its trunk keeps the release's
163,840-row embedding so that every id the project hard-codes (markers, media tokens, the stop
token) means the same thing. `write_tiny_tokenizer` therefore writes:
- `tiktoken.model`: all 256 single bytes (rank = byte value) followed by byte-pair merges learned
  from the small built-in text below (deterministic: the most frequent pair wins, ties go to the
  smallest pair), ranks contiguous from 0;
- `tokenizer_config.json`: the release's special-token table (ids 163,584..163,839, same names,
  same special / non-special flags).
Both load with `Tokenizer.from_pretrained`. Ids between the last merge and 163,584 are unused.
"""

from __future__ import annotations

import base64
import json
import re
from collections import Counter
from pathlib import Path

from textcore.tokenizer import NAMED_SPECIAL_TOKENS

NUM_MERGES = 400

# Training text: the chat markup the renderer emits, a little prose, code and JSON.
_CORPUS = """\
message role="system" type="tool-declare" message role="user" message role="assistant"
message role="tool" tool="bash" index="1" think response tools call argument key="command" type="string"
type="number" type="boolean" type="object" type="array" type="null" thinking-effort response-format
# Tools
Here are the available tools, described in JSONSchema.
The system is invoked with `thinking_effort=max`. You are a helpful assistant.
What is in this image? Describe the picture in one sentence, then list the objects you can see.
The image shows a small red house next to a large green tree under a clear blue sky.
There is a cat sitting on the window and a bicycle leaning against the wall of the house.
Please answer the question about the image and explain your reasoning step by step.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
It is the time of the year when the weather changes and the days become shorter and colder.
The model reads the image first, then the question, and it answers with a short and clear response.
When the user asks for a tool, the assistant calls the tool with the right arguments and waits for the result.
The result of the tool is returned to the assistant, which then writes the final answer for the user.
Images are split into patches; each patch becomes a token, and the tokens are merged before the language model.
A conversation is a list of messages. Each message has a role and a content, and some have a name.
The server renders the conversation into a prompt, encodes the prompt into tokens, and streams the output.
Error: the request is missing a field. Please check the request and try again with a valid value.
def render(messages, tools=None):
    for message in messages:
        if message["role"] == "user":
            return message["content"]
    return None
{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city",
"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
image 1024x768 image 448x448 image 640x480 width height pixels patch tokens vision tower embedding
0 1 2 3 4 5 6 7 8 9 10 11 12 16 28 32 64 100 128 256 512 1000 1024 2048
"""

_PRETOKEN = re.compile(r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+")


def learn_merges(text: str, num_merges: int) -> list[bytes]:
    """New tokens, in rank order, from byte-pair merges over the pre-tokens of `text`."""
    words = Counter(tuple(bytes([b]) for b in piece.encode("utf-8")) for piece in _PRETOKEN.findall(text))
    known = {bytes([b]) for b in range(256)}
    tokens: list[bytes] = []
    while len(tokens) < num_merges:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        if pairs[best] < 2:
            break
        merged = best[0] + best[1]
        if merged not in known:
            known.add(merged)
            tokens.append(merged)
        words = Counter({_merge(word, best, merged): count for word, count in words.items()})
    return tokens


def _merge(word: tuple[bytes, ...], pair: tuple[bytes, bytes], merged: bytes) -> tuple[bytes, ...]:
    out: list[bytes] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def tokenizer_config() -> dict:
    """The release's `tokenizer_config.json` special-token table (no other release content)."""
    decoder = {
        str(token_id): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": special}
        for token_id, (name, special) in sorted(NAMED_SPECIAL_TOKENS.items())
    }
    names = {token_id: name for token_id, (name, _) in NAMED_SPECIAL_TOKENS.items()}
    return {
        "added_tokens_decoder": decoder,
        "bos_token": names[163_584],
        "eos_token": names[163_585],
        "unk_token": names[163_838],
        "pad_token": names[163_839],
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "TikTokenTokenizer",
        "comment": "kimi-vision tiny vocabulary (generated; not the Kimi-K3 release vocabulary)",
    }


def tiny_tokenizer_files(num_merges: int = NUM_MERGES) -> dict[str, bytes]:
    """`tiktoken.model` and `tokenizer_config.json` of the tiny vocabulary, as file name -> bytes."""
    tokens = [bytes([b]) for b in range(256)] + learn_merges(_CORPUS, num_merges)
    lines = [f"{base64.b64encode(token).decode('ascii')} {rank}" for rank, token in enumerate(tokens)]
    return {
        "tiktoken.model": ("\n".join(lines) + "\n").encode("ascii"),
        "tokenizer_config.json": (json.dumps(tokenizer_config(), indent=2) + "\n").encode("utf-8"),
    }


def write_tiny_tokenizer(out_dir: str | Path, num_merges: int = NUM_MERGES) -> Path:
    """Write `tiktoken.model` and `tokenizer_config.json` into `out_dir` (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in tiny_tokenizer_files(num_merges).items():
        (out / name).write_bytes(data)
    return out
