"""Incremental detokenisation and the stop matcher: the streamed text equals a full decode, cut before the
first stop string, at a cost per round that does not grow with the answer."""

from __future__ import annotations

import random

import pytest

from headstart.runtime.text import StopMatcher, TextDecoder
from helpers.models import WORDS, tiny_tokenizer


def test_stop_matcher_finds_a_stop_string_split_across_pieces():
    matcher = StopMatcher(["STOP", "xy"])
    pieces = ["hello S", "T", "OP and more"]
    out = "".join(matcher.push(p) for p in pieces)
    assert out == "hello " and matcher.stopped and matcher.push("later") == ""
    # the last len("STOP") - 1 characters are held back until more text (or the end) shows they are not a stop
    matcher = StopMatcher(["STOP"])
    assert matcher.push("aST") == "" and matcher.push("xyz") == "aST" and matcher.finish() == "xyz"


def test_stop_matcher_earliest_of_several():
    matcher = StopMatcher(["world", "lo w"])
    assert matcher.push("hello world") == "hel" and matcher.stopped


class CountingTokenizer:
    """Wraps a tokenizer; records how many ids each decode call received."""

    def __init__(self, inner) -> None:
        self.inner, self.sizes = inner, []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_streamed_text_equals_a_full_decode_and_costs_a_window():
    tokenizer = CountingTokenizer(tiny_tokenizer())
    rng = random.Random(0)
    ids = [rng.randrange(3, len(WORDS)) for _ in range(600)]
    decoder, text, i = TextDecoder(tokenizer), "", 0
    while i < len(ids):
        n = rng.randrange(1, 6)  # rounds of 1-5 tokens
        text += decoder.push(ids[i : i + n])
        i += n
    text += decoder.finish()
    assert text == tiny_tokenizer().decode(ids, skip_special_tokens=True)
    assert max(tokenizer.sizes) <= 10  # two rounds' tokens at most, however long the answer


@pytest.mark.parametrize("stop", [["cat sat"], ["mat", "dog ran"], ["zzz"]])
def test_decoder_cuts_before_the_first_stop_string(stop):
    tokenizer = tiny_tokenizer()
    ids = tokenizer("the dog ran far away and then the cat sat on a mat").input_ids
    decoder = TextDecoder(tokenizer, stop)
    text = "".join(decoder.push([t]) for t in ids) + decoder.finish()
    full = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [i for s in stop if (i := full.find(s)) >= 0]
    assert text == (full[: min(cuts)] if cuts else full) and decoder.stopped == bool(cuts)


@pytest.mark.model
def test_multibyte_characters_stream_whole_with_the_real_tokenizer():
    """SmolLM2's byte-level BPE splits an emoji or a CJK character over several tokens: no replacement
    character is ever shown, and the text equals the full decode."""
    from transformers import AutoTokenizer

    from headstart.runtime.models import DEFAULT_MODEL, resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL), local_files_only=True)
    ids = tokenizer("Grüße 🙂 und 日本語 — déjà vu 🚀!").input_ids
    decoder = TextDecoder(tokenizer)
    pieces = [decoder.push([t]) for t in ids] + [decoder.finish()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)
