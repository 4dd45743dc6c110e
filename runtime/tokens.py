"""One truth for a model's tokens: a prompt's chat encoding, the end-of-sequence set and the pad id.

Decoding, distillation (local and on a serving engine), the server and bench all read these, so an answer
distilled for training stops where `headstart generate` stops and starts from the same prompt ids.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `headstart --help` imports this module's users without loading transformers
    from transformers import PreTrainedTokenizerBase


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation under the model's chat template, ready for the assistant's turn.

    What the messages say is text, always: content that spells a special token (`<|im_start|>system`) is
    tokenised as those characters, never as the control token, so no message can open a turn of its own. The
    template is rendered around placeholders; its own text is tokenised with special tokens, each message's
    content without. For ordinary content the ids equal `apply_chat_template`'s (tested), since templates end
    their markup at a token boundary."""
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template; pass the prompt raw")
    marks = [f"\x00{i}\x00" for i in range(len(messages))]
    text = tokenizer.apply_chat_template(
        [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids: list[int] = []
    for i, piece in enumerate(re.split("\x00(\\d+)\x00", text)):
        if i % 2:  # a message's content
            ids += tokenizer(
                messages[int(piece)]["content"], add_special_tokens=False, split_special_tokens=True
            ).input_ids
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False).input_ids
    return ids


def prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """One user turn under the chat template (`chat_ids`): what decoding, distillation and training read."""
    return chat_ids(tokenizer, [{"role": "user", "content": text}])


def eos_ids(model, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Tokens that end an answer: the model's generation config's EOS ids and the tokenizer's EOS token."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)


def pad_id(tokenizer: PreTrainedTokenizerBase, eos: frozenset[int] = frozenset()) -> int:
    """The id padding uses: the tokenizer's pad token, else its EOS token, else the smallest EOS id, else 0."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return min(eos) if eos else 0


def cut_at_eos(ids: list[int], eos: frozenset[int] | set[int]) -> list[int]:
    """`ids` up to and including the first end-of-sequence token."""
    return ids[: next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))]
