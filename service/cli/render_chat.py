"""`kimi-vision render-chat REQUEST.json [--ids] [--tokenizer DIR]`: show the K3 prompt for a chat.

REQUEST.json is `{"messages": [...], "tools": [...], <other render options>}` (options as in
`textcore.chat.render`, e.g. `thinking_effort`, `tool_choice`, `response_format`,
`add_generation_prompt`). Prints the rendered prompt; with `--ids`, prints one JSON object
`{"text": ..., "ids": [...]}` instead. Ids need a tokenizer: `--tokenizer DIR`, else the
directory in `$KIMI_K3_TOKENIZER_DIR` (e.g. the release files), else the project's tiny
vocabulary written to a temporary directory. The tokenizer used is named on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

TOKENIZER_ENV = "KIMI_K3_TOKENIZER_DIR"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request", help="JSON file ('-' for stdin): {\"messages\": [...], \"tools\": ..., options}")
    parser.add_argument("--ids", action="store_true", help="also encode the prompt and print {text, ids} as JSON")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help=f"directory with tiktoken.model + tokenizer_config.json (default: ${TOKENIZER_ENV}, "
                             "else the project's tiny vocabulary)")


def _load_request(source: str) -> dict:
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {source}: {exc.strerror or exc}") from None
    try:
        request = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON: {exc}") from None
    if not isinstance(request, dict) or "messages" not in request:
        raise ValueError(f"{source} must be a JSON object with a 'messages' list")
    return request


def run(args: argparse.Namespace) -> int:
    from textcore.chat import ChatError, render
    from textcore.tokenizer import Tokenizer, TokenizerError

    try:
        request = _load_request(args.request)
        messages = request.pop("messages")
        tools = request.pop("tools", None)
        segments = render(messages, tools, **request)
        text = "".join(segment.text for segment in segments)
        if not args.ids:
            return _write(text + "\n")
        directory = args.tokenizer or os.environ.get(TOKENIZER_ENV)
        if directory:
            tokenizer = Tokenizer.from_pretrained(directory)
            print(f"tokenizer: {directory}", file=sys.stderr)
        else:
            from textcore.tiny_vocab import write_tiny_tokenizer

            with tempfile.TemporaryDirectory(prefix="kimi-tiny-tokenizer-") as tmp:
                tokenizer = Tokenizer.from_pretrained(write_tiny_tokenizer(tmp))
            print(f"tokenizer: the project's tiny vocabulary (not the release; set ${TOKENIZER_ENV} or --tokenizer)",
                  file=sys.stderr)
        ids = tokenizer.encode_segments(segments)
    except (ChatError, TokenizerError, ValueError) as exc:
        print(f"render-chat: {exc}", file=sys.stderr)
        return 2
    return _write(json.dumps({"text": text, "ids": ids}, ensure_ascii=False) + "\n")


def _write(output: str) -> int:
    try:
        sys.stdout.write(output)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into `head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")  # so the flush at interpreter exit does not fail again
    return 0
