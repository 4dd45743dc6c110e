"""Draft heads on a tiny random Llama: shapes, the Medusa label shift, checkpoints bound to their target."""

from __future__ import annotations

import pytest
import torch

from headstart.heads.checkpoint import (
    CheckpointConfig,
    HeadsMismatchError,
    build_heads,
    save_heads,
    target_fingerprint,
)
from headstart.heads.eagle import EagleHead
from headstart.heads.load import load_heads
from headstart.heads.medusa import MedusaHeads
from helpers.models import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=64, init_std=0.2)


def test_medusa_shapes_and_untied_blocks(model):
    heads = MedusaHeads(hidden_size=64, vocab_size=64, num_heads=3)
    hidden = torch.randn(2, 5, 64)
    logits = heads(hidden, model.lm_head)
    assert logits.shape == (3, 2, 5, 64)
    # zero-initialised blocks: every head starts as the target's own next-token logits
    torch.testing.assert_close(logits[1], model.lm_head(hidden))
    heads.blocks[0].linear.weight.data.fill_(1.0)
    assert heads.blocks[1].linear.weight.abs().sum() == 0  # not tied (the `[ResBlock] * K` trap)
    own = MedusaHeads(64, 64, num_heads=2, own_lm_head=True)
    own.init_lm_heads(model.lm_head)
    torch.testing.assert_close(own(hidden, model.lm_head)[0], model.lm_head(hidden))


def test_eagle_shapes_and_dropped_input_norm(model):
    head = EagleHead.for_target(model)
    assert isinstance(head.layer, type(model.model.layers[0]))
    assert isinstance(head.layer.input_layernorm, torch.nn.Identity)
    features, embeds = torch.randn(2, 6, 64), torch.randn(2, 6, 64)
    positions = torch.arange(6)[None].expand(2, 6)
    out = head(features, embeds, positions)
    assert out.shape == (2, 6, 64)
    # causal: changing the last input leaves earlier predictions alone
    features2 = features.clone()
    features2[:, -1] += 1
    out2 = head(features2, embeds, positions)
    torch.testing.assert_close(out[:, :-1], out2[:, :-1])
    assert not torch.allclose(out[:, -1], out2[:, -1])


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_save_load_round_trip(model, kind, tmp_path):
    heads = build_heads(kind, model)
    for p in heads.parameters():  # make them non-trivial
        p.data.normal_(0, 0.05)
    fp = target_fingerprint(model, name="tiny")
    save_heads(tmp_path, heads, kind, {}, fp, {"dtype": "float32", "metrics": {"head_1/top1": 0.5}})
    loaded, config = load_heads(tmp_path, model)
    assert config.kind == kind and config.extra["metrics"]["head_1/top1"] == 0.5
    # the typed config is what config.json says, read and written in one place
    assert CheckpointConfig.read(tmp_path) == config and CheckpointConfig.from_json(config.to_json()) == config
    assert config.dtype == "float32" and config.target == fp and config.rank_accuracy is None
    assert CheckpointConfig.find(tmp_path) == config and CheckpointConfig.find(tmp_path / "nowhere") is None
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_loading_onto_another_target_names_both(model, tmp_path):
    save_heads(tmp_path, build_heads("medusa", model), "medusa", {}, target_fingerprint(model, name="tiny-a"))
    other = tiny_llama(vocab_size=64, init_std=0.2, seed=7)
    other.config.name_or_path = "tiny-b"
    with pytest.raises(HeadsMismatchError, match=r"trained for tiny-a .* not for the target tiny-b"):
        load_heads(tmp_path, other)
    with pytest.raises(ValueError, match="not a heads checkpoint"):
        load_heads(tmp_path / "nowhere", model)
