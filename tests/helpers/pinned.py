"""Pinned losses: five AdamW steps of each head kind on one fixed batch of a tiny model.

tests/pinned_losses.json holds the values `test_fixed_batch_losses_are_pinned` compares with. After a
deliberate change of a loss, regenerate them (and say why in the commit):

    make pinned        # = cd tests && python -m helpers.pinned
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from headstart.heads.checkpoint import build_heads
from headstart.heads.losses import eagle3_loss, eagle_loss, medusa_loss
from headstart.heads.vocab import DraftReadout
from headstart.train.config import LoraConfig
from headstart.train.medusa2 import AdaptedTarget, attach_lora, medusa2_loss
from helpers.models import tiny_llama

PINNED_FILE = Path(__file__).resolve().parents[1] / "pinned_losses.json"
KINDS = ("medusa", "medusa2", "eagle", "eagle-unroll3", "eagle3-unroll3")


def fixed_batch_losses(kind: str) -> list[float]:
    """The five losses of `kind` (medusa, medusa2, eagle, eagle-unrollN, eagle3-unrollN) on the fixed batch."""
    model = tiny_llama(vocab_size=64, init_std=0.2)
    torch.manual_seed(0)
    head_kind, _, unroll = kind.partition("-unroll")
    heads = build_heads(head_kind, model)
    if head_kind == "eagle3":
        heads.init_lm_head(model.lm_head)
    if head_kind in ("medusa", "medusa2"):
        for p in heads.parameters():  # zero-initialised blocks would make every head equal at step 0
            p.data.normal_(0, 0.02)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :3] = False
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    hidden = states[-1]
    params = list(heads.parameters())
    if head_kind == "medusa2":  # a LoRA on both layers' attention and MLP output trains with the heads
        lora = LoraConfig(r=2, alpha=4.0, target_modules=["q_proj", "v_proj", "down_proj"], lr=1e-2, kl_weight=1.0)
        joint = AdaptedTarget(attach_lora(model, lora), heads)
        params += [p for p in joint.target.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(5):
        if head_kind == "medusa2":
            loss = medusa2_loss(
                joint,
                heads,
                model.lm_head,
                model.lm_head.weight,
                ids,
                torch.ones_like(ids),
                mask,
                heads.num_heads,
                lora.kl_weight,
            )
        elif head_kind == "medusa":
            loss = medusa_loss(heads, hidden, model.lm_head, ids, mask, heads.num_heads)
        elif head_kind == "eagle3":  # the fused layers and the final feature; p over the full vocabulary
            fused = torch.cat([states[k] for k in (*heads.feature_layers, -1)], dim=-1)
            readout = DraftReadout(model.lm_head, None)
            loss = eagle3_loss(
                heads,
                fused,
                model.model.embed_tokens,
                heads.logits,
                readout,
                ids,
                mask,
                int(unroll),
                fused_width=heads.fc.in_features,
            )
        else:
            embed, lm_head = model.model.embed_tokens, model.lm_head
            loss, _ = eagle_loss(heads, hidden, embed, lm_head, ids, mask, unroll=int(unroll or 1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def load_pinned() -> dict[str, list[float]]:
    return json.loads(PINNED_FILE.read_text())


if __name__ == "__main__":
    values = {kind: [round(x, 6) for x in fixed_batch_losses(kind)] for kind in KINDS}
    PINNED_FILE.write_text(json.dumps(values, indent=2) + "\n")
    print(f"wrote {PINNED_FILE}: {values}")
