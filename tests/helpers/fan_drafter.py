"""The fan kind's own drafter (helpers/fan_kind.py): its head's top-`fan` guesses for the root's child, as
siblings (point masses, so exact at every temperature). Reached through the kind: `make_drafter("fan", ...)`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.registry import Context, Entry, trained_heads
from headstart.runtime.tree import DraftTree


@dataclass(frozen=True)
class FanDrafterOptions:
    heads: str | None = None  # the trained fan heads' directory
    allow_adapter_mismatch: bool = False
    fan: int = 2  # siblings drafted under the root


class FanDrafter(Drafter):
    name = "fan"
    feature_layers = (-1,)  # the target's final feature, after its norm

    def __init__(self, head, lm_head, fan: int) -> None:
        self.head, self.readout, self.fan = head, head.readout(lm_head), fan
        self._feature: torch.Tensor | None = None  # (H,) the target's feature just before the root

    def start(self, prompt_ids, prompt_hidden, sampling=None, seed=None) -> None:
        self._feature = prompt_hidden[-1] if prompt_hidden is not None and len(prompt_hidden) else None

    @torch.inference_mode()
    def propose(self, context: list[int]) -> DraftTree:
        if self._feature is None:
            return DraftTree()
        top = self.head(self._feature[None], self.readout)[0].topk(self.fan).indices  # (fan,) draft indices
        return DraftTree(self.readout.to_target(top).tolist(), [-1] * self.fan)

    def observe(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, next_token: int) -> None:
        self._feature = hidden[path[-1] + 1] if path else hidden[0]


def _build(options: FanDrafterOptions, ctx: Context) -> FanDrafter:
    head, _ = trained_heads("fan", options, ctx)
    return FanDrafter(head, ctx.model.get_output_embeddings(), options.fan)


ENTRY = Entry(FanDrafterOptions, _build, "the fan kind's top guesses as siblings (a test's kind)", positional="fan")
