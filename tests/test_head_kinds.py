"""A head kind is one module and one registry line: a toy kind defined here, registered, and then trained, saved,
loaded and decoded exactly by the unchanged trainer, checkpoint reader and drafters (heads/kinds.py); a second one
(helpers/fan_kind.py) brings its own drafter and training option. Every registered kind has a drafter, trains,
saves, loads and exports or refuses to."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headstart.heads.checkpoint import CheckpointConfig
from headstart.heads.export import ExportError, export_heads
from headstart.heads.kinds import KINDS, HeadKind, get_kind
from headstart.heads.vocab import DraftReadout
from headstart.runtime.drafters.registry import entry, make_drafter, parse_spec
from headstart.runtime.models import load_model
from headstart.train.config import ConfigError
from helpers.exactness import assert_greedy_identity, train_tiny_heads
from helpers.fan_drafter import FanDrafter
from helpers.fan_kind import FAN


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


def test_a_kind_with_its_own_drafter_and_training_option(tmp_path, tiny_model_dir, monkeypatch):
    """helpers/fan_kind.py and helpers/fan_drafter.py plus this one registry line: no edit of the engine, the
    bench or train/config.py. The option trains, is saved, and the drafter is reached by the kind's name."""
    monkeypatch.setitem(KINDS, "fan", FAN)
    with pytest.raises(ConfigError, match=r"unknown config key 'heads.options.depth' \(known: width\)"):
        train_tiny_heads(tmp_path / "bad", tiny_model_dir, "fan", **{"heads.options.depth": 2})
    with pytest.raises(ConfigError, match="the medusa kind takes no options of its own"):
        train_tiny_heads(tmp_path / "medusa", tiny_model_dir, "medusa", **{"heads.options.width": 2})
    heads_dir = train_tiny_heads(tmp_path, tiny_model_dir, "fan", steps=30, **{"heads.options.width": 2})
    config = CheckpointConfig.read(heads_dir)
    assert config.kind == "fan" and config.options["width"] == 2 and config.rank_accuracy[0][0] > 0
    model, tokenizer = load_model(str(tiny_model_dir))
    model.generation_config.eos_token_id = None
    assert parse_spec("fan:3").value == 3
    drafter = make_drafter("fan:3", model, tokenizer, heads=str(heads_dir))
    assert isinstance(drafter, FanDrafter) and drafter.fan == 3 and drafter.head.mlp[0].out_features == 2 * 64
    prompts = [[3, 4, 5, 6, 3, 4], [10, 11, 12, 13, 14, 15, 16], [20, 21]]
    assert assert_greedy_identity(model, drafter, prompts).accepted > 0
    assert assert_greedy_identity(model, make_drafter("fan+lookup", model, tokenizer, heads=str(heads_dir)), prompts)
    with pytest.raises(ValueError, match="holds fan heads, not medusa heads"):
        make_drafter("medusa", model, tokenizer, heads=str(heads_dir))
    with pytest.raises(ExportError, match="only EAGLE-3 heads export"):
        export_heads(heads_dir, tmp_path / "export")


@pytest.mark.parametrize("name", ["medusa", "medusa2", "eagle", "eagle3"])
def test_every_registered_kind_has_a_drafter_trains_saves_loads_and_exports_or_refuses(name, tmp_path, tiny_model_dir):
    assert sorted(KINDS) == ["eagle", "eagle3", "medusa", "medusa2"]  # a kind registered here is tested here
    kind = KINDS[name]
    assert entry(kind.drafter_name) is not None
    heads_dir = train_tiny_heads(tmp_path, tiny_model_dir, name, steps=3)
    config = CheckpointConfig.read(heads_dir)
    assert config.kind == name and len(config.rank_accuracy) == 3  # evaluated at the kind's depth
    adapter = str(heads_dir) if kind.trains_target else None  # Medusa-2's heads decode beside their LoRA's target
    model, tokenizer = load_model(str(tiny_model_dir), adapter=adapter)
    drafter = make_drafter(kind.drafter_name, model, tokenizer, heads=str(heads_dir))
    assert drafter.name == kind.drafter_name and len(drafter.propose([1, 2, 3])) == 0  # no feature before start
    if kind.export_refusal is None:
        assert (export_heads(heads_dir, tmp_path / "export") / "model.safetensors").exists()
    else:
        with pytest.raises(ExportError, match=kind.export_refusal[:20]):
            export_heads(heads_dir, tmp_path / "export")
