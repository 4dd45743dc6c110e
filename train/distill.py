"""Self-distillation: the target answers each prompt under its chat template; heads learn its own outputs.

Rows go to JSONL shards (`shard-00000.jsonl`, ...) that `datasets.load_dataset("json", ...)` reads:
`{"id", "category", "prompt_ids", "response_ids"}`, written as they finish. Killed and restarted with the
same command, it skips every id already written and cuts a half-written last line, so no row is duplicated
or lost. The folder's manifest records what made its rows (`train/sources.py`). The prompts are answered by
the decode loop's offline driver (`runtime.generate.decode_all`: continuous batching, the prompts' shared
prefix computed once); `backend="hf"` keeps transformers' batched `generate`, the path it replaced.

    headstart distill --prompts ../shared/data/train/prompts.jsonl --out runs/distill/smollm2 --permissive-only

`--derive TASK` answers prompts built over the target's own earlier answers in the same folder
instead (`derived_prompts`, tasks in `DERIVED`): the permissive training prompts hold few summarisation
tasks (2,780 news articles) and no translation, and those answers are text that may be used under the same
licences. `summary` asks for a summary of an answer; `to-german` for the German of an answer's
opening sentences; `from-german` for the English of what the target wrote in German.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from headstart.runtime.prompts import Prompt
from headstart.runtime.tokens import cut_at_eos, eos_ids, pad_id, prompt_ids
from headstart.train.shards import Shards, row_seed, shard_rows


def _summary_text(text: str, n_tokens: int) -> str | None:
    return text if n_tokens >= 80 else None


def _opening_text(text: str, n_tokens: int, max_words: int = 30) -> str | None:
    """The answer's first line, cut after the last sentence end within `max_words` words."""
    words = text.split("\n", 1)[0].split()
    if len(words) < 6:
        return None
    head = " ".join(words[:max_words])
    end = max(head.rfind(". "), head.rfind("? "), head.rfind("! "))
    return head[: end + 1] if end > 0 and len(words) > max_words else head


GERMAN_WORDS = frozenset(
    [
        "der",
        "die",
        "das",
        "und",
        "ist",
        "ein",
        "eine",
        "nicht",
        "mit",
        "für",
        "zu",
        "den",
        "von",
        "ich",
        "wir",
        "sie",
        "es",
        "auf",
        "im",
        "dem",
    ]
)


def _german_text(text: str, n_tokens: int, max_words: int = 40) -> str | None:
    """The first line of what the target wrote in German, if it looks German; its loops cut short."""
    words = text.split("\n", 1)[0].strip().strip('"').split()[:max_words]
    if len(words) < 4 or sum(w.lower() in GERMAN_WORDS for w in words) < 2:
        return None
    return " ".join(words)


@dataclass(frozen=True)
class DerivedTask:
    category: str
    templates: tuple[str, ...]  # one per row, chosen by a hash of its id
    source: str | None  # the task whose rows it reads; None: the original answers (not derived, not code)
    text: Callable[[str, int], str | None]  # (answer text, its tokens) -> the text the prompt embeds, or None


DERIVED = {
    "summary": DerivedTask(
        "summarization", ("Summarize the following text in two or three sentences.\n\n{text}",), None, _summary_text
    ),
    "to-german": DerivedTask(
        "translation",
        (
            "Translate into German: {text}",
            "Translate the following text to German:\n\n{text}",
            "How would you say this in German? {text}",
        ),
        None,
        _opening_text,
    ),
    "from-german": DerivedTask(
        "translation",
        (
            "Translate German to English: {text}",
            "Translate the following German text into English:\n\n{text}",
            "What does this mean in English? {text}",
            "Translate to English: {text}",
        ),
        "to-german",
        _german_text,
    ),
}


def derived_prompts(task: str, distilled: str | Path, tokenizer, limit: int) -> list[Prompt]:
    """Prompts of `task` (a key of DERIVED) over the first `limit` usable answers in `distilled`.

    Ids are `task:<source id>`. The rows are read in shard order, so a rerun over a folder that has
    grown since picks the same first rows.
    """
    spec = DERIVED[task]
    distilled = Path(distilled)
    if not any(distilled.glob("shard-*.jsonl")):
        raise ValueError(f"no distilled shards (shard-*.jsonl) in {distilled}: run `headstart distill` first")
    prompts: list[Prompt] = []
    for row in shard_rows(distilled):
        made_by = next((name for name in DERIVED if row["id"].startswith(name + ":")), None)
        if made_by != spec.source or (made_by is None and row["category"] == "code"):
            continue
        text = tokenizer.decode(row["response_ids"], skip_special_tokens=True).strip()
        text = spec.text(text, len(row["response_ids"]))
        if text is None:
            continue
        template = spec.templates[int(hashlib.sha256(row["id"].encode()).hexdigest(), 16) % len(spec.templates)]
        prompts.append(Prompt(f"{task}:{row['id']}", spec.category, template.format(text=text)))
        if len(prompts) == limit:
            return prompts
    if not prompts:
        raise ValueError(f"no answer in {distilled} is usable for the {task} task")
    return prompts


def _batches(prompts: list[Prompt], size: int) -> Iterator[list[Prompt]]:
    for i in range(0, len(prompts), size):
        yield prompts[i : i + size]


BACKENDS = ("batched", "hf")  # our continuous-batching loop (default); transformers' batched generate


def distill(
    model,
    tokenizer,
    prompts: list[Prompt],
    out: str | Path,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    batch_size: int = 64,
    rows_per_shard: int = 1000,
    seed: int = 0,
    backend: str = "batched",
    skip_ids: frozenset[str] = frozenset(),
    progress: bool = True,
    prepack: bool = True,
    source: dict | None = None,
) -> dict:
    """Answer every prompt not answered yet (in `out` or in `skip_ids`); returns throughput figures.

    `backend` "batched": `batch_size` sequences decode together in the decode loop (`runtime.generate.decode_all`),
    a finished one's slot refilled at once, rows written as they finish; "hf": transformers' `generate` on
    batches of `batch_size` left-padded prompts (the earlier path, kept to compare against). `prepack`: the
    batched backend's linear layers prepacked in place (`runtime/kernels.py`). The folder's manifest
    (`train/sources.py`) must agree with this target and these settings; the run is recorded there with `source`
    (the prompt file and filter that chose `prompts`)."""
    import torch  # here, not at the top: `headstart --help` reads DERIVED without loading torch

    from headstart.train.sources import made_by, open_manifest, record_run

    if backend not in BACKENDS:
        raise ValueError(f"unknown distillation backend {backend!r}: use one of {', '.join(BACKENDS)}")
    shards = Shards(out, rows_per_shard)
    open_manifest(out, made_by(model, tokenizer, max_new_tokens, temperature))
    todo = [p for p in prompts if p.id not in shards.done and p.id not in skip_ids]
    # Similar lengths together: less padding per batch. The order is fixed by the prompt list.
    encoded = {p.id: prompt_ids(tokenizer, p.text) for p in todo}
    todo.sort(key=lambda p: len(encoded[p.id]))
    eos = eos_ids(model, tokenizer)
    new_tokens, t0 = 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc="distill", unit="row", dynamic_ncols=True, disable=not progress)

    def written(rows: list[dict]) -> None:
        nonlocal new_tokens
        shards.append(rows)  # on disk before anything else is decoded
        new_tokens += sum(len(r["response_ids"]) for r in rows)
        bar.update(len(rows))
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")

    if backend == "batched" and todo:
        from headstart.runtime.generate import Request, SharedPrefix, decode_all
        from headstart.runtime.sampling import SamplingParams
        from headstart.runtime.target import Target

        target = Target(model, fast=prepack, slots=min(batch_size, len(todo)))  # prepacks in place (fast)
        sampling = SamplingParams(temperature=temperature)
        requests = [
            Request(
                encoded[p.id],
                sampling=sampling,
                max_new_tokens=min(max_new_tokens, target.max_len - len(encoded[p.id])),
                eos_ids=eos,
                seed=row_seed(seed, p.id),
                owner=p,
            )
            for p in todo
        ]
        for r in decode_all(target, requests, SharedPrefix.common([r.prompt_ids for r in requests])):
            response = r.context[len(r.prompt_ids) :]
            written(
                [{"id": r.owner.id, "category": r.owner.category, "prompt_ids": r.prompt_ids, "response_ids": response}]
            )
    pad = pad_id(tokenizer, eos)
    for batch in _batches(todo, batch_size) if backend == "hf" else ():
        ids = [encoded[p.id] for p in batch]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=model.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=model.device)
        kwargs = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature}
        torch.manual_seed(seed + len(shards.done))
        gen = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad, **kwargs)
        written(
            [
                {"id": p.id, "category": p.category, "prompt_ids": x, "response_ids": cut_at_eos(row, eos)}
                for p, x, row in zip(batch, ids, gen[:, width:].tolist(), strict=True)
            ]
        )
    bar.close()
    seconds = time.perf_counter() - t0
    if todo:
        record_run(out, {**(source or {}), "backend": backend, "new_rows": len(todo), "new_tokens": new_tokens})
    return shards.figures(len(todo), new_tokens, seconds)


def compare_backends(
    model, tokenizer, prompts: list[Prompt], out: str | Path, max_new_tokens: int, batch_size: int
) -> dict:
    """Distil `prompts` with transformers' `generate` (stock kernels) and then with the batched loop, into
    `out`/hf and `out`/batched (empty folders), at T = 0; returns both runs' figures and how many rows agree."""
    runs = {}
    for backend in ("hf", "batched"):  # hf first: the batched backend prepacks the model in place
        folder = Path(out) / backend
        if any(folder.glob("shard-*.jsonl")):
            raise ValueError(f"{folder} already holds shards: compare into an empty folder")
        runs[backend] = distill(model, tokenizer, prompts, folder, max_new_tokens, 0.0, batch_size, backend=backend)
    rows = {b: {r["id"]: r["response_ids"] for r in shard_rows(Path(out) / b)} for b in runs}
    same = sum(rows["hf"][i] == rows["batched"].get(i) for i in rows["hf"])
    ratio = runs["batched"]["tokens_per_s"] / runs["hf"]["tokens_per_s"]
    return {"hf": runs["hf"], "batched": runs["batched"], "speedup": ratio, "same_rows": same, "rows": len(rows["hf"])}
