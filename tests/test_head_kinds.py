"""A head kind is one module and one registry line: a toy kind defined here, registered, and then trained, saved,
loaded and decoded exactly by the unchanged trainer, checkpoint reader and drafters (heads/kinds.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headstart.heads.checkpoint import CheckpointConfig
from headstart.heads.kinds import KINDS, HeadKind, get_kind
from headstart.heads.vocab import DraftReadout
from headstart.runtime.drafters.registry import make_drafter
from headstart.runtime.models import load_model
from helpers.exactness import assert_greedy_identity, train_tiny_heads


class ToyHead(nn.Module):
    """The smallest head kind: one residual MLP on the target's final feature at t guesses token t + 2. It speaks
    the Medusa drafter's interface (`num_heads`, `features`, `head_logits`, `readout`), so that drafter runs it."""

    num_heads = 1

    def __init__(self, hidden: int, draft_vocab: int = 0) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        nn.init.zeros_(self.mlp[2].weight)  # starts as the target's own next-token guess
        nn.init.zeros_(self.mlp[2].bias)
        self.register_buffer("draft_vocab", torch.zeros(draft_vocab, dtype=torch.long) if draft_vocab else None)

    def readout(self, lm_head: nn.Module, limit: int | None = None) -> DraftReadout:
        return DraftReadout(lm_head, self.draft_vocab, limit)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:  # (..., H) -> (1, ..., H)
        return (hidden + self.mlp(hidden))[None]

    def head_logits(self, k: int, feature: torch.Tensor, readout) -> torch.Tensor:
        return readout(feature)

    def forward(self, hidden: torch.Tensor, readout) -> torch.Tensor:
        return readout(self.features(hidden)[0])


def toy_loss(module, head, hidden, batch, tools, step) -> torch.Tensor:
    """Cross-entropy against token t + 2 at answer positions, through the module's forward (DDP sees it)."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    valid = mask[:, 2:]
    logits = module(hidden[:, :-2][valid], tools.readout)
    return F.cross_entropy(logits.float(), ids[:, 2:][valid])


def toy_depths(head, hidden, ids, depths, tools) -> list[torch.Tensor]:
    return [head.head_logits(1, head.features(hidden)[0], tools.readout)]


TOY = HeadKind(
    "toy",
    lambda model, **options: ToyHead(model.config.hidden_size, **options),
    "medusa",
    toy_loss,
    toy_depths,
    static_tree=True,
)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(KINDS, "toy", TOY)  # the one registry line, undone after the test
    return TOY


def test_a_registered_kind_trains_saves_loads_and_decodes_exactly(tmp_path, tiny_model_dir, toy):
    heads_dir = train_tiny_heads(tmp_path, tiny_model_dir, "toy", steps=30, **{"heads.num_heads": 1})
    config = CheckpointConfig.read(heads_dir)
    assert config.kind == "toy" and len(config.rank_accuracy) == 1 and config.rank_accuracy[0][0] > 0
    model, tokenizer = load_model(str(tiny_model_dir))
    model.generation_config.eos_token_id = None
    drafter = make_drafter("medusa", model, tokenizer, heads=str(heads_dir))  # the drafter the kind names
    prompts = [[3, 4, 5, 6, 3, 4], [10, 11, 12, 13, 14, 15, 16], [20, 21]]
    assert assert_greedy_identity(model, drafter, prompts).accepted > 0
    with pytest.raises(ValueError, match="holds toy heads, not eagle heads"):
        make_drafter("eagle", model, tokenizer, heads=str(heads_dir))


def test_unknown_kinds_are_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match="unknown head kind 'mtp': choose one of medusa, medusa2, eagle, eagle3"):
        get_kind("mtp")
