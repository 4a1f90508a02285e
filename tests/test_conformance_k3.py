"""Conformance with the Kimi-K3 release: every golden of `shared/conformance/kimi-k3/`.

The goldens were produced by the unmodified release (`encoding_k3.py`, `tokenization_kimi.py`,
its `tiktoken.model` and `tokenizer_config.json`); see the README beside them. They are read
from `<repo>/../shared/conformance/kimi-k3/`, or from `$KIMI_K3_CONFORMANCE_DIR`; they are never
copied into the repository. Where they are absent the whole module is skipped with the reason.
"""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
from conformance_data import K3_DIR

from textcore.chat import render, render_ids
from textcore.parser import StreamParser
from textcore.tokenizer import NUM_BASE_TOKENS, VOCAB_SIZE, Tokenizer

FILES = ("tiktoken.model", "tokenizer_config.json", "kimi_k3_chat_goldens.json", "kimi_k3_chat_template_goldens.json",
         "kimi_k3_tokenizer_goldens.json")
_missing = [name for name in FILES if not (K3_DIR / name).is_file()]
if _missing:
    pytest.skip(f"Kimi-K3 conformance data not found in {K3_DIR} (missing {', '.join(_missing)}); "
                "set KIMI_K3_CONFORMANCE_DIR to a directory holding the release tokenizer and the goldens",
                allow_module_level=True)


def _load(name: str) -> dict:
    return json.loads((K3_DIR / name).read_text(encoding="utf-8"))


TOKENIZER_GOLDENS = _load("kimi_k3_tokenizer_goldens.json")
CHATS = _load("kimi_k3_chat_goldens.json")["chats"]
TEMPLATE_CHATS = _load("kimi_k3_chat_template_goldens.json")["chats"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(K3_DIR)


def test_the_golden_sets_are_complete():
    # The acceptance criterion is "all goldens": fail loudly if a file shrinks.
    assert (len(CHATS), len(TEMPLATE_CHATS)) == (18, 5)
    assert (len(TOKENIZER_GOLDENS["texts"]), len(TOKENIZER_GOLDENS["long_texts"])) == (20, 4)


def test_vocabulary_is_the_release_one(tok):
    provenance = TOKENIZER_GOLDENS["provenance"]
    digest = hashlib.sha256((K3_DIR / "tiktoken.model").read_bytes()).hexdigest()
    assert digest == provenance["tiktoken_model_sha256"]
    assert tok.num_base_tokens == provenance["num_base_tokens"] == NUM_BASE_TOKENS
    assert tok.vocab_size == provenance["n_vocab"] == VOCAB_SIZE


@pytest.mark.parametrize(("name", "token_id"), sorted(TOKENIZER_GOLDENS["special_tokens"].items()))
def test_special_tokens(tok, name, token_id):
    assert tok.token_id(name) == token_id
    assert tok.encode(name, allow_special=True) == [token_id]
    assert tok.encode(name) != [token_id]


@pytest.mark.parametrize("name", sorted(TOKENIZER_GOLDENS["texts"]))
def test_texts(tok, name):
    case = TOKENIZER_GOLDENS["texts"][name]
    assert tok.encode(case["text"]) == case["ids"]
    assert tok.encode(case["text"], allow_special=True) == case["ids_allow_special"]
    assert tok.decode(case["ids"]) == case["text"]


@pytest.mark.parametrize("name", sorted(TOKENIZER_GOLDENS["long_texts"]))
def test_long_inputs(tok, name):
    case = TOKENIZER_GOLDENS["long_texts"][name]
    text = case["unit"] * case["count"] + case["suffix"]
    ids = tok.encode(text, allow_special=True)  # the release's encode allows specials by default
    assert len(ids) == case["num_ids"]
    assert hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest() == case["ids_sha256"]
    assert tok.decode(ids) == text


@pytest.mark.parametrize("name", sorted(CHATS))
def test_build_chat_segments_goldens(tok, name):
    case = CHATS[name]
    inputs = copy.deepcopy((case["messages"], case["tools"], case["kwargs"]))
    # These come from the layer below apply_chat_template, which adds no thinking-effort message.
    segments = render(case["messages"], case["tools"], **{"thinking_effort": None, **case["kwargs"]})
    assert [[s.text, s.special] for s in segments] == case["segments"]
    assert "".join(s.text for s in segments) == case["text"]
    assert tok.encode_segments(segments) == case["ids"]
    assert (case["messages"], case["tools"], case["kwargs"]) == inputs


@pytest.mark.parametrize("name", sorted(TEMPLATE_CHATS))
def test_apply_chat_template_goldens(tok, name):
    case = TEMPLATE_CHATS[name]
    prompt = render_ids(tok, case["messages"], case["tools"], **case["kwargs"])  # default thinking_effort="max"
    assert prompt.text == case["text"]
    assert prompt.ids == case["ids"]


def test_parser_reads_back_the_golden_assistant_turns(tok):
    """Every golden assistant turn, re-rendered as a completion, parses back to the message."""
    checked = 0
    for case in CHATS.values():
        for message in case["messages"]:
            if message["role"] != "assistant" or not isinstance(message.get("content", ""), str):
                continue
            unnamed = {key: value for key, value in message.items() if key != "name"}  # the model writes no name
            turn = render([unnamed], add_generation_prompt=False, thinking_effort=None)
            prefix = render([], thinking_effort=None)
            assert turn[:len(prefix)] == prefix
            parser = StreamParser(tok)
            parser.feed(tok.encode_segments(turn[len(prefix):]))
            result = parser.finish()
            assert result["content"] == message.get("content", "")
            assert result["reasoning_content"] == (message.get("reasoning_content") or "").strip() and result["stopped"]
            for call, parsed in zip(message.get("tool_calls", []), result["tool_calls"], strict=True):
                arguments = call["function"]["arguments"]
                assert parsed["name"] == call["function"]["name"]
                assert parsed["arguments"] == (json.loads(arguments) if isinstance(arguments, str) else arguments)
            checked += 1
    assert checked >= 8
