"""A second toy head kind, with its own drafter (helpers/fan_drafter.py) and its own training option (`width`):
the kind a test registers with one line to show that a kind needs no edit of the engine, the bench or
train/config.py. Its head is one MLP on the target's final feature at t, `width` times the hidden size wide,
guessing token t + 2 (the root's child)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from headstart.heads.kinds import HeadKind
from headstart.heads.vocab import DraftReadout


@dataclass
class FanOptions:
    """The kind's own training options: `heads.options.width` in a training config."""

    width: int = 1  # the MLP's hidden width, in multiples of the target's hidden size


class FanHead(nn.Module):
    def __init__(self, hidden: int, draft_vocab: int = 0, width: int = 1) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden, width * hidden), nn.SiLU(), nn.Linear(width * hidden, hidden))
        nn.init.zeros_(self.mlp[2].weight)  # starts as the target's own next-token guess
        nn.init.zeros_(self.mlp[2].bias)
        self.register_buffer("draft_vocab", torch.zeros(draft_vocab, dtype=torch.long) if draft_vocab else None)

    def readout(self, lm_head: nn.Module, limit: int | None = None) -> DraftReadout:
        return DraftReadout(lm_head, self.draft_vocab, limit)

    def forward(self, hidden: torch.Tensor, readout) -> torch.Tensor:  # (..., H) -> (..., N)
        return readout(hidden + self.mlp(hidden))


def _loss(module, head, hidden, batch, tools, step) -> torch.Tensor:
    """Cross-entropy against token t + 2 at answer positions, through the module's forward (DDP sees it)."""
    valid = batch["loss_mask"][:, 2:]
    logits = module(hidden[:, :-2][valid], tools.readout)
    return F.cross_entropy(logits.float(), batch["input_ids"][:, 2:][valid])


FAN = HeadKind(
    "fan",
    lambda model, **options: FanHead(model.config.hidden_size, **options),
    "helpers.fan_drafter:ENTRY",  # its own drafter, decoded as `--drafter fan`
    _loss,
    lambda head, hidden, ids, depths, tools: [head(hidden, tools.readout)],
    training_options=lambda cfg: {"draft_vocab": cfg.draft_vocab, "width": cfg.options.width},
    eval_depth=lambda head, cfg: 1,
    options=FanOptions,
    sized=False,
)
