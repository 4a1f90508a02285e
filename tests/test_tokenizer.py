"""Tokenizer tests on the project's own tiny vocabulary (the release files are covered by
test_conformance_k3.py)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from textcore import tokenizer as tk
from textcore.tiny_vocab import write_tiny_tokenizer
from textcore.tokenizer import Tokenizer, TokenizerError, split_long_runs

MARKERS = [name for name, _ in tk.NAMED_SPECIAL_TOKENS.values()] + ["<|reserved_token_163700|>"]
# Text that likes to contain spelled-out control tokens.
marker_text = st.lists(st.one_of(st.text(max_size=20), st.sampled_from(MARKERS)), max_size=8).map("".join)






def test_constants_match_the_spec():
    assert (tk.BOS_ID, tk.EOS_ID, tk.END_OF_MSG_ID) == (163584, 163585, 163586)
    assert (tk.OPEN_ID, tk.CLOSE_ID, tk.SEP_ID) == (163587, 163588, 163589)
    media = (tk.MEDIA_BEGIN_ID, tk.MEDIA_CONTENT_ID, tk.MEDIA_END_ID, tk.MEDIA_PAD_ID)
    assert media == (163602, 163603, 163604, 163605)
    assert tk.VOCAB_SIZE == 163840 and (tk.UNK_ID, tk.PAD_ID) == (163838, 163839)


def test_tiny_vocabulary_is_deterministic_and_well_formed(tiny_tokenizer_dir, tmp_path, tiny_tokenizer):
    again = write_tiny_tokenizer(tmp_path / "again")
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_tokenizer_dir / name).read_bytes()
    ranks = tk.load_ranks(tiny_tokenizer_dir / "tiktoken.model")
    assert sorted(ranks.values()) == list(range(len(ranks)))
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert 200 <= len(ranks) - 256 <= 400  # a few hundred merges
    assert tiny_tokenizer.vocab_size == tk.VOCAB_SIZE
    # Merges make common text shorter than its bytes.
    assert len(tiny_tokenizer.encode("The assistant calls the tool")) < len("The assistant calls the tool") // 2


def test_special_table_matches_the_release_layout(tiny_tokenizer):
    for token_id, (name, special) in tk.NAMED_SPECIAL_TOKENS.items():
        assert tiny_tokenizer.token_id(name) == token_id
        assert tiny_tokenizer.encode(name, allow_special=True) == [token_id]
        assert (token_id in tiny_tokenizer.skippable_ids) == special
    assert tiny_tokenizer.token_id("<|reserved_token_163592|>") == 163592
    assert tiny_tokenizer.special_names[163837] == "<|reserved_token_163837|>"
    assert len(tiny_tokenizer.special_names) == 256
    with pytest.raises(TokenizerError, match="not a special token"):
        tiny_tokenizer.token_id("<|nope|>")


def test_skip_special_tokens_keeps_the_non_special_markers(tiny_tokenizer):
    ids = tiny_tokenizer.encode("<|open|>a<|sep|>b<|close|>c<|end_of_msg|>[BOS]<|media_pad|><|reserved_token_163700|>",
                     allow_special=True)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == "<|open|>a<|sep|>b<|close|>c"
    assert tiny_tokenizer.decode(ids) == ("<|open|>a<|sep|>b<|close|>c<|end_of_msg|>[BOS]<|media_pad|>"
                                          "<|reserved_token_163700|>")


def test_ids_outside_the_vocabulary_are_refused(tiny_tokenizer):
    for bad in (-1, tiny_tokenizer.num_base_tokens, 100_000, tk.VOCAB_SIZE):
        with pytest.raises(TokenizerError, match=f"token id {bad} "):
            tiny_tokenizer.decode([1, bad])
    with pytest.raises(TokenizerError, match="needs a str"):
        tiny_tokenizer.encode(b"bytes")  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(text=marker_text)
def test_text_never_yields_control_ids_without_allow_special(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text)
    assert all(i < tk.NUM_BASE_TOKENS for i in ids)
    assert tiny_tokenizer.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(segments=st.lists(st.tuples(marker_text, st.booleans()), max_size=6))
def test_encode_segments_is_segment_wise(tiny_tokenizer, segments):
    expected = [i for text, special in segments for i in tiny_tokenizer.encode(text, special)]
    assert tiny_tokenizer.encode_segments(segments) == expected


def _reference_split(text: str, max_run: int) -> list[str]:
    """The release's character loop, kept here as the oracle for the regex-based splitter."""
    pieces, start, run, in_space = [], 0, 0, (text[0].isspace() if text else False)
    for i, char in enumerate(text):
        if char.isspace() != in_space:
            run, in_space = 1, char.isspace()
        else:
            run += 1
            if run > max_run:
                pieces.append(text[start:i])
                start, run = i, 1
    pieces.append(text[start:])
    return pieces


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("ab \n\t\u3000\u00a0x"), max_size=80),
       max_run=st.integers(min_value=1, max_value=9))
def test_long_run_split_matches_the_release_loop(text, max_run):
    expected = _reference_split(text, max_run) if len(text) > max_run else [text]
    assert split_long_runs(text, max_run) == expected


def test_long_inputs_are_cut_before_tiktoken(tiny_tokenizer):
    run = "x" * (tk.MAX_CONSECUTIVE_CHARS * 2 + 7)
    assert [len(p) for p in split_long_runs(run)] == [tk.MAX_CONSECUTIVE_CHARS] * 2 + [7]
    assert list(map(len, tk.split_for_encoding("ab " * 200_000))) == [400_000, 200_000]
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(run + " tail")) == run + " tail"


def test_bad_directories_get_clear_errors(tmp_path, tiny_tokenizer_dir):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tiktoken.model").write_bytes((tiny_tokenizer_dir / "tiktoken.model").read_bytes())
    config = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["163587"]["special"] = True
    (bad / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=re.escape("id 163587 must be '<|open|>'")):
        Tokenizer.from_pretrained(bad)
    (bad / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        Tokenizer.from_pretrained(bad)
    (bad / "tiktoken.model").write_text("YQ== 0\nYg== 2\n")
    with pytest.raises(TokenizerError, match="contiguous"):
        Tokenizer.from_pretrained(bad)
    (bad / "tiktoken.model").write_text("YQ== 0\n")
    with pytest.raises(TokenizerError, match="every single byte"):
        tk.load_ranks(bad / "tiktoken.model")
