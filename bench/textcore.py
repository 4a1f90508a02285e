"""Benchmark: K3 tokenizer encode throughput and chat render latency (CPU).

    .venv/bin/python -m bench.textcore [--tokenizer DIR] [--repeats N]

- encode: tokens/s of `Tokenizer.encode` on 1 MiB of mixed text (prose, code, JSON, Chinese,
  emoji, numbers, long whitespace), next to plain tiktoken `encode_ordinary` on the same text in
  the same run (the ratio shows what the release's chunking costs; the ids differ only where
  chunking changes them);
- render: `chat.render` (segments) and `render_ids` (segments + ids) of a 200-message agentic
  conversation; target < 10 ms for render.

The tokenizer is `--tokenizer`, else `$KIMI_K3_TOKENIZER_DIR`, else the release files in
`../shared/conformance/kimi-k3/` if present, else the project's tiny vocabulary. Figures are the
best of `--repeats` runs (the machine is shared; best-of is the least noisy estimate).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import best_of
from textcore.chat import render, render_ids
from textcore.tiny_vocab import write_tiny_tokenizer
from textcore.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
RELEASE_DIR = REPO_ROOT.parent / "shared/conformance/kimi-k3"

SAMPLES = [
    "The quick brown fox jumps over the lazy dog. It's what they'd expect, isn't it? ",
    "def area(w: int, h: int) -> int:\n    return w * h  # pixels\n\n",
    '{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Seoul", "days": 3}}}\n',
    "你好，世界！这是一个多模态模型的测试文本，包含图像和文字。",
    "Kimi K3 は画像を理解します。 Привет, мир! مرحبا بالعالم ",
    "hello 👋🏽 world 🇯🇵 🧑‍💻 done ✅ ",
    "3.14159 2.71828 1024x768 0xFF 1e-9 42 ",
    "    \n\t\t  \n",
    "cd /app && git diff --binary HEAD~1 > /tmp/x.patch; echo $? ",
]


def mixed_text(n_bytes: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        sample = rng.choice(SAMPLES)
        parts.append(sample)
        size += len(sample.encode("utf-8"))
    return "".join(parts)


def agentic_conversation(n_messages: int = 200) -> tuple[list[dict], list[dict]]:
    tools = [{"type": "function", "function": {
        "name": name, "description": f"Run {name}.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
                       "required": ["command"]}}} for name in ("bash", "grep", "read_file", "write_file")]
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent."},
                            {"role": "user", "content": "Fix the failing test in the repository."}]
    step = 0
    while len(messages) < n_messages:
        call_ids = [f"call_{step}_{k}" for k in range(2)]
        messages.append({
            "role": "assistant", "reasoning_content": f"Step {step}: inspect the output, then decide the next command.",
            "content": f"Running step {step}.",
            "tool_calls": [{"id": cid, "type": "function", "function": {
                "name": "bash", "arguments": f'{{"command": "pytest -x tests/test_{step}.py", "timeout": 60}}'}}
                for cid in call_ids]})
        for cid in reversed(call_ids):  # results out of order: exercises the repair
            messages.append({"role": "tool", "tool_call_id": cid, "content": f"{cid}: 3 passed, 1 failed\n" * 5})
        step += 1
    return messages[:n_messages], tools




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", help="tokenizer directory (default: see module docstring)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    directory = args.tokenizer or os.environ.get("KIMI_K3_TOKENIZER_DIR")
    if not directory and (RELEASE_DIR / "tiktoken.model").is_file():
        directory = str(RELEASE_DIR)
    tmp = None
    if not directory:
        tmp = tempfile.TemporaryDirectory()
        directory = str(write_tiny_tokenizer(tmp.name))
        label = "tiny (project-generated)"
    else:
        label = directory
    start = time.perf_counter()
    tok = Tokenizer.from_pretrained(directory)
    load_s = time.perf_counter() - start
    print(f"tokenizer: {label} (load {load_s * 1000:.0f} ms)")

    text = mixed_text(1 << 20)
    n_tokens = len(tok.encode(text))
    encode_s = best_of(lambda: tok.encode(text), args.repeats, warmup=False)
    raw_s = best_of(lambda: tok._encoding.encode_ordinary(text), args.repeats, warmup=False)
    print(f"encode 1 MiB mixed text: {n_tokens} tokens, {n_tokens / encode_s / 1e6:.2f} M tokens/s "
          f"({encode_s * 1000:.0f} ms); plain tiktoken encode_ordinary {n_tokens / raw_s / 1e6:.2f} M tokens/s "
          f"({raw_s * 1000:.0f} ms); ratio {encode_s / raw_s:.2f}x")

    messages, tools = agentic_conversation(200)
    render(messages, tools)  # warm-up
    rounds = range(max(args.repeats, 20))
    runs = [best_of(lambda: render(messages, tools), 1, warmup=False) for _ in rounds]
    ids_runs = [best_of(lambda: render_ids(tok, messages, tools), 1, warmup=False) for _ in rounds]
    prompt = render_ids(tok, messages, tools)
    print(f"render 200-message agentic chat ({len(prompt.ids)} tokens): render min {min(runs) * 1000:.2f} ms, "
          f"median {statistics.median(runs) * 1000:.2f} ms (target < 10 ms); render_ids min {min(ids_runs) * 1000:.2f} "
          f"ms, median {statistics.median(ids_runs) * 1000:.2f} ms")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
