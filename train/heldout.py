"""The committed held-out list: prompts no shipped head trained on, on which every session scores its heads.

Shipped heads are trained on from session to session (docs/training.md, "The ledger"), so their held-out rows
cannot be chosen per run (a hash of the tokens moves when rows are added). `configs/heldout-ids.txt` names the
prompts once; `headstart distill` never answers them into training folders (they are in its default
`--exclude`), training drops them from every source by id and scores its heads on their answers
(`data.heldout`).

Which prompts no shipped head saw: the EAGLE-1 and Medusa heads trained on the first 8,400 permissive prompts
in file order (and tasks derived from their answers); the EAGLE-3 head on the shared folders and on its own
distillation, which answered the shortest prompts first (fewer than the first `TRAINED_FRONTIER` of them by
chat-templated length outside the shared folders). The list takes prompts from beyond both, short enough
that prompt + a 128-token answer fits a 512-token training row, chosen by a hash of their ids:

    python -m headstart.train.heldout --out configs/heldout-ids.txt
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from headstart.runtime.prompts import Prompt
from headstart.train.config import HELDOUT_IDS
from headstart.train.sources import answered_ids, held_out

TRAINED_IN_FILE_ORDER = 8400  # the EAGLE-1 / Medusa heads' distillation: `--limit 8400`
# the EAGLE-3 head's own 12,544 rows were the shortest outside the first shared folder: the second shared folder's
# 10,112 and the next 2,432 (15,748 existed by the time its run ended): 6,000 past the shared folders clears both
TRAINED_FRONTIER = 6000
MAX_PROMPT_TOKENS = 384  # + 128 answer tokens = 512, the training configs' max_len


def choose(
    prompts: list[Prompt],  # the permissive prompts in file order, tuning and evaluation prompts already dropped
    lengths: dict[str, int],  # chat-templated prompt tokens by id
    shared: frozenset[str],  # ids answered in the shared distilled folders
    n: int,
    in_file_order: int = TRAINED_IN_FILE_ORDER,
    frontier: int = TRAINED_FRONTIER,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
) -> list[str]:
    """`n` prompt ids no shipped head trained on (module docstring), in the order of their hash."""
    early = {p.id for p in prompts[:in_file_order]}
    rest = sorted((p for p in prompts if p.id not in shared), key=lambda p: lengths[p.id])  # distill's order
    beyond = [p for p in rest[frontier:] if p.id not in early and lengths[p.id] <= max_prompt_tokens]
    if len(beyond) < n:
        raise ValueError(f"only {len(beyond)} prompts lie beyond what the shipped heads trained on; asked for {n}")
    return sorted((p.id for p in beyond), key=lambda i: hashlib.sha256(i.encode()).hexdigest())[:n]


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from headstart.runtime.models import DEFAULT_MODEL, resolve_model_dir
    from headstart.runtime.prompts import load_prompts
    from headstart.runtime.tokens import prompt_ids

    parser = argparse.ArgumentParser(description="Write the committed held-out prompt list.")
    parser.add_argument("--prompts", default="../shared/data/train/prompts.jsonl")
    parser.add_argument(
        "--shared",
        nargs="*",
        default=[
            "../shared/data/distilled/smollm2-135m-instruct",
            "../shared/data/distilled/smollm2-135m-instruct-bf16",
        ],
    )
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--out", default=HELDOUT_IDS)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL), local_files_only=True)
    prompts = load_prompts(args.prompts, permissive_only=True, skip_malformed=True)
    spec_bench = "../shared/data/eval/spec_bench.jsonl"
    tuning = ["configs/tune-prompts.jsonl", "configs/tune-derived.jsonl", spec_bench]
    prompts, _ = held_out(prompts, [f for f in tuning if Path(f).is_file()])
    lengths = {p.id: len(prompt_ids(tokenizer, p.text)) for p in prompts}
    ids = choose(prompts, lengths, answered_ids(args.shared), args.n)
    header = (
        f"# {len(ids)} held-out prompt ids of {args.prompts} (headstart.train.heldout: no shipped head trained on "
        f"them)\n# python -m headstart.train.heldout --n {args.n} --out {args.out}\n"
    )
    Path(args.out).write_text(header + "".join(f"{i}\n" for i in ids))
    print(f"{len(ids)} ids -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
