"""Drafters: everything that proposes a DraftTree for the one verifier.

A drafter sees the sequence (prompt + accepted tokens, the root last) and returns a tree of guesses
for what follows the root. It is told what the target accepted after every round, so drafters that
keep state (EAGLE features, a draft model's cache) can stay in sync; stateless ones ignore it.
"""

from __future__ import annotations

import torch

from runtime.tree import DraftTree


class Drafter:
    """Base class: proposes nothing (plain decoding)."""

    name = "none"

    def start(self, prompt_ids: list[int], prompt_hidden: torch.Tensor | None) -> None:
        """A new sequence begins; `prompt_hidden` (len-1, H) are the target's features of all but the root."""

    def propose(self, context: list[int]) -> DraftTree:
        """A tree of guesses for the tokens after `context[-1]`."""
        return DraftTree()

    def observe(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, next_token: int) -> None:
        """The target accepted `path` of `tree` (its features `hidden`, (n+1, H)) and chose `next_token`."""


def make_drafter(name: str, **options: int) -> Drafter:
    """Build a drafter by its CLI name."""
    if name == "none":
        return Drafter()
    if name == "lookup":
        from runtime.drafters.lookup import LookupDrafter

        return LookupDrafter(**options)
    raise ValueError(f"unknown drafter '{name}': choose none or lookup")
