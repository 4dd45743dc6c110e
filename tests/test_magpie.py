"""Magpie prompts (train/magpie.py): the open user turn, the filters, sampling, and a run that resumes."""

from __future__ import annotations

import json

import pytest

from headstart.train import magpie as mp
from helpers.models import tiny_llama, tiny_tokenizer


def test_the_user_turn_is_left_open_where_the_template_writes_the_message():
    tok = tiny_tokenizer()
    start, end = mp.open_user_turn(tok)
    assert tok.convert_ids_to_tokens(start) == ["user", ":"]  # "{{ role }} : {{ content }} ": cut at the content
    assert end == []  # nothing after the message but a space: the turn ends at EOS
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
    assert mp.open_user_turn(tok)[1] == [tok.eos_token_id]
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"  # drops the message
    with pytest.raises(mp.MagpieError, match="once as given"):
        mp.open_user_turn(tok)
    tok.chat_template = None
    with pytest.raises(mp.MagpieError, match="no chat template"):
        mp.open_user_turn(tok)


def test_the_filter_refuses_each_kind_of_bad_turn_and_keeps_the_rest():
    held = "Summarise the article below in three sentences for a reader who has not seen it"
    f = mp.PromptFilter([held])
    assert f.check("How do I sort a list of tuples by their second item in Python?", ended=True) is None
    assert f.check("What is the capital of France and why", ended=False) == "cut at the token limit"
    assert f.check("Explain recursion", ended=True) == "too short"
    assert f.check("Что такое рекурсия и зачем она нужна?", ended=True) == "not English"
    assert f.check("how do i SORT a list of tuples, by their second item in python", ended=True) == "seen before"
    near_held = "Please summarise the article below in three sentences for a reader who has not seen it yet."
    assert f.check(near_held, ended=True) == "near a held-out prompt"  # shares an 8-word run with it
    assert f.check("Summarise the article below in two short lines", ended=True) is None  # no 8-word run shared
    near_kept = "How do I sort a list of tuples by their second item in Python quickly?"
    assert f.check(near_kept, ended=True) == "near a kept prompt"  # most of its 8-word runs are a kept prompt's
    assert f.rejected == {
        "cut at the token limit": 1,
        "too short": 1,
        "not English": 1,
        "seen before": 1,
        "near a held-out prompt": 1,
        "near a kept prompt": 1,
    }


def test_turns_are_sampled_from_the_open_turn_one_seed_each():
    model, tok = tiny_llama(vocab_size=len(tiny_tokenizer().get_vocab()), init_std=0.3), tiny_tokenizer()
    turns = mp.sample_turns(model, tok, first_seed=5, batch_size=3, max_prompt_tokens=6, temperature=1.0)
    got = [next(turns) for _ in range(8)]
    seeds = [s for s, _, _ in got]
    assert len(set(seeds)) == 8 and min(seeds) >= 5 and max(seeds) < 5 + 8 + 2  # in finishing order, 3 at a time
    for _, text, ended in got:
        assert ended or len(text.split()) <= 6  # cut at the limit (special tokens not written) unless it ended
    again = dict((s, t) for s, t, _ in got)
    turns = mp.sample_turns(model, tok, first_seed=5, batch_size=1, max_prompt_tokens=6, temperature=1.0)
    assert next(turns)[1] == again[5]  # a seed's turn is the same alone


def test_a_run_stops_at_its_count_and_the_next_resumes_after_it(tmp_path, monkeypatch):
    texts = {s: f"question number {s} about the cats and the dogs" for s in range(40)}
    texts[3] = texts[1]  # a repeat: refused
    texts[4] = "please tell me how a rainbow forms in the sky after rain"
    asked = []

    def turns(model, tokenizer, first_seed, *args):
        asked.append(first_seed)
        for s in range(first_seed, 40):
            yield s, texts[s], s != 2  # seed 2's turn was cut

    monkeypatch.setattr(mp, "sample_turns", turns)
    out = tmp_path / "magpie" / "prompts.jsonl"
    stats = mp.magpie(None, None, out, 3, ["Tell me how a rainbow forms in the sky, briefly."], progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["magpie-0", "magpie-1", "magpie-5"]  # 2 cut, 3 seen, 4 near the protected
    assert stats == {
        "prompts": 3,
        "sampled": 6,
        "refused": {"cut at the token limit": 1, "seen before": 1, "near a held-out prompt": 1},
    }
    assert rows[0]["turns"] == [texts[0]] and rows[0]["permissive"] is True
    with out.open("a") as f:
        f.write('{"source": "magpie", "id": "magp')  # a kill mid-line
    stats = mp.magpie(None, None, out, 5, [], progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert asked == [0, 6] and [r["id"] for r in rows][3:] == ["magpie-6", "magpie-7"]
    assert stats["prompts"] == 5 and mp.magpie(None, None, out, 5, [], progress=False)["sampled"] == 0
