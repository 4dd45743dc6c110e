"""Prompts the target writes itself (Magpie): its chat template's user turn left open, the model samples what a user
would ask, up to the turn's end; kept where they pass the filters, as prompt rows `headstart distill` answers.

    headstart magpie --out $R/magpie/prompts.jsonl --count 20000 [--batch-size 64] [--seed 0] [--dtype bfloat16]
    headstart distill --prompts $R/magpie/prompts.jsonl --out $R/distill/magpie --max-new-tokens 128 ...

Filters (`PromptFilter`): the turn ended before `max_prompt_tokens` (a cut one is half a question), at least
MIN_WORDS words, nearly all ASCII (this model writes English; what else it writes is mostly broken), no text seen
before up to case, spacing and punctuation, and no run of NEAR_WORDS words shared with a held-out, tuning or
Spec-Bench prompt (`headstart distill`'s held-out files) or, for half of its runs or more, with a prompt kept before.
Rows are appended as they pass (the file is the checkpoint): a second run with the same --out keeps them, rebuilds
the filter from them and samples on from the next seed. Nothing here is committed: prompts are data, written
outside the work tree.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

MIN_WORDS = 4
NEAR_WORDS = 8  # a run of this many words shared with a protected prompt makes a prompt near it
ASCII_SHARE = 0.97
MARK = "\u2063MAGPIE\u2063"  # a user message that no template writes itself: where the user's text would go
SOURCE = "magpie"


class MagpieError(ValueError):
    """A target whose chat template has no user turn to leave open: one line naming why."""


def open_user_turn(tokenizer) -> tuple[list[int], list[int]]:
    """(the ids a chat starts with up to the user's first word, the token that ends a user turn, [] where EOS does): the
    template rendered around MARK and cut there."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise MagpieError("the target's tokenizer has no chat template: it has no user turn to leave open")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    if text.count(MARK) != 1:
        raise MagpieError("the chat template does not write the user's message once as given: no turn to leave open")
    before, after = text.split(MARK)
    start = tokenizer(before, add_special_tokens=False)["input_ids"]
    end = tokenizer(after, add_special_tokens=False)["input_ids"][:1]  # none: the turn ends at EOS
    if not end and tokenizer.eos_token_id is None:
        raise MagpieError("the chat template writes nothing after the user's message and there is no EOS token")
    return start, end


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def runs(tokens: list[str], n: int = NEAR_WORDS) -> set[tuple[str, ...]]:
    """Every run of `n` consecutive words (the whole text where it is shorter)."""
    if len(tokens) <= n:
        return {tuple(tokens)}
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


class PromptFilter:
    """Which sampled user turns become prompts (module docstring); `protected`: texts none may be near."""

    def __init__(self, protected: Iterable[str] = ()) -> None:
        self.protected: set[tuple[str, ...]] = set()
        for text in protected:
            self.protected |= runs(words(text))
        self.seen: set[tuple[str, ...]] = set()  # the kept prompts' words, whole
        self.kept_runs: set[tuple[str, ...]] = set()
        self.rejected: dict[str, int] = {}

    def check(self, text: str, ended: bool) -> str | None:
        """Why `text` is refused (None: kept, and remembered); `ended`: the turn ended before the token limit."""
        tokens = words(text)
        reason = None
        if not ended:
            reason = "cut at the token limit"
        elif sum(c.isascii() for c in text) < ASCII_SHARE * len(text):
            reason = "not English"
        elif len(tokens) < MIN_WORDS:
            reason = "too short"
        elif tuple(tokens) in self.seen:
            reason = "seen before"
        else:
            own = runs(tokens)
            if own & self.protected:
                reason = "near a held-out prompt"
            elif 2 * len(own & self.kept_runs) >= len(own):
                reason = "near a kept prompt"
        if reason is not None:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1
            return reason
        self._remember(tokens, own)
        return None

    def keep(self, text: str) -> None:
        """Remember a prompt kept before (a resumed run's rows)."""
        tokens = words(text)
        self._remember(tokens, runs(tokens))

    def _remember(self, tokens: list[str], own: set[tuple[str, ...]]) -> None:
        self.seen.add(tuple(tokens))
        self.kept_runs |= own


def protected_texts(files: Iterable[str | Path], prompts: str | Path | None) -> list[str]:
    """The texts of the held-out, tuning and Spec-Bench prompts: JSONL files' own, a `.txt` list's ids read from
    `prompts` (the training prompt file they name rows of)."""
    from headstart.runtime.prompts import load_prompts
    from headstart.train.sources import read_ids

    texts, ids = [], set()
    for f in files:
        if str(f).endswith(".txt"):
            ids |= set(read_ids(f))
        else:
            texts += [p.text for p in load_prompts(f, skip_malformed=True)]
    if ids and prompts is not None and Path(prompts).is_file():
        texts += [p.text for p in load_prompts(prompts, skip_malformed=True) if p.id in ids]
    return texts


def read_kept(out: Path) -> list[dict]:
    """The rows an earlier run wrote to `out` (none where it does not exist)."""
    if not out.is_file():
        return []
    lines = [line for line in out.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise MagpieError(f"{out} line {i + 1} is not JSON: not a prompt file this command wrote") from None
            out.write_text("".join(json.dumps(row) + "\n" for row in rows))  # a last line cut by a kill: dropped
    return rows


def sample_turns(
    model, tokenizer, first_seed: int, batch_size: int, max_prompt_tokens: int, temperature: float
) -> Iterator[tuple[int, str, bool]]:
    """User turns sampled from the open turn, seeds first_seed, first_seed + 1, ... for as long as it is read: (seed,
    text, whether the turn ended before `max_prompt_tokens`), as they finish (the decode loop's continuous
    batching, `batch_size` at once)."""
    from headstart.runtime.generate import Request, SharedPrefix, decode_all
    from headstart.runtime.sampling import SamplingParams
    from headstart.runtime.target import Target

    start, end = open_user_turn(tokenizer)
    target = Target(model, fast=True, slots=batch_size)
    stop = frozenset(end) | frozenset([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    sampling = SamplingParams(temperature=temperature)
    requests = (
        Request(list(start), sampling=sampling, max_new_tokens=max_prompt_tokens, eos_ids=stop, seed=s, owner=s)
        for s in itertools.count(first_seed)
    )
    for r in decode_all(target, requests, SharedPrefix.common([start, start])):  # short of the last token
        new = r.context[len(r.prompt_ids) :]
        ended = bool(new) and new[-1] in stop
        text = tokenizer.decode(new[:-1] if ended else new, skip_special_tokens=True).strip()
        yield r.owner, text, ended


def magpie(
    model,
    tokenizer,
    out: str | Path,
    count: int,
    protected: Iterable[str],
    *,
    seed: int = 0,
    batch_size: int = 64,
    max_prompt_tokens: int = 96,
    temperature: float = 1.0,
    progress: bool = True,
) -> dict:
    """Sample user turns until `out` holds `count` prompts (module docstring); returns what was sampled, kept and
    refused (by reason)."""
    from tqdm import tqdm

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = read_kept(out)
    filt = PromptFilter(protected)
    for row in kept:
        filt.keep(row["turns"][0])
    next_seed = max((row.get("seed", -1) + 1 for row in kept), default=seed)
    sampled, bar = (
        0,
        tqdm(total=count, initial=min(len(kept), count), desc="magpie", unit="prompt", disable=not progress),
    )
    with out.open("a") as f:
        turns = sample_turns(model, tokenizer, next_seed, batch_size, max_prompt_tokens, temperature)
        for s, text, ended in turns if len(kept) < count else ():
            sampled += 1
            if filt.check(text, ended) is not None:
                continue
            row = {"source": SOURCE, "group": SOURCE, "id": f"{SOURCE}-{s}", "category": SOURCE, "turns": [text]}
            row |= {"license": "the target's output", "permissive": True, "seed": s}
            f.write(json.dumps(row) + "\n")
            f.flush()
            kept.append(row)
            bar.update(1)
            if len(kept) >= count:
                break
    bar.close()
    return {"prompts": len(kept), "sampled": sampled, "refused": dict(filt.rejected)}
