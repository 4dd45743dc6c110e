"""One truth for tokens (runtime/tokens.py): decoding and distillation encode and stop alike."""

from __future__ import annotations

import json

import pytest

from headstart.runtime.engine import Engine
from headstart.runtime.models import load_model
from headstart.runtime.prompts import Prompt
from headstart.runtime.tokens import eos_ids, pad_id, prompt_ids
from headstart.train.distill import distill


def test_decoding_and_distillation_stop_at_the_same_place(tmp_path, tiny_model_dir):
    # a model whose generation config names one EOS and whose tokenizer names another: both end an answer
    model, tok = load_model(str(tiny_model_dir))
    model.generation_config.eos_token_id = None
    text = "the cat sat on"
    ids = prompt_ids(tok, text)
    free = Engine(model, tok).generate(ids, max_new_tokens=16).token_ids  # no EOS yet: the free continuation
    first = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # a token not seen before it
    later = next(i for i in range(first + 1, len(free)) if free[i] not in free[:i])
    model.generation_config.eos_token_id = free[later]
    tok.eos_token = tok.convert_ids_to_tokens(free[first])
    assert eos_ids(model, tok) == {free[first], free[later]}
    want = free[: first + 1]
    assert Engine(model, tok).generate(ids, max_new_tokens=16).token_ids == want
    for backend in ("batched", "hf"):
        out = tmp_path / backend
        distill(model, tok, [Prompt("a", "x", text)], out, max_new_tokens=16, backend=backend, progress=False)
        row = json.loads((out / "shard-00000.jsonl").read_text())
        assert row["prompt_ids"] == ids and row["response_ids"] == want, backend


def test_pad_id_falls_back_to_eos():
    class Tok:
        pad_token_id, eos_token_id = None, 7

    assert pad_id(Tok()) == 7
    Tok.eos_token_id = None
    assert pad_id(Tok(), frozenset({9, 4})) == 4 and pad_id(Tok()) == 0


def test_a_model_without_a_chat_template_is_refused(tiny_model_dir):
    _, tok = load_model(str(tiny_model_dir))
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        prompt_ids(tok, "hi")
