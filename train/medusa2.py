"""Medusa-2: Medusa heads trained together with a LoRA on the target, with self-distillation.

The target gets a peft LoRA (`heads.lora`: rank, modules, layers). Both train under one loss:

    loss = sum_k CE(head k, token t+k+1) + kl_weight * KL(p || p')

where p is the ORIGINAL target's next-token distribution (the adapter disabled, no gradient) and
p' the ADAPTED target's: the heads pull the backbone's features towards what they can predict, the
KL term keeps the model's own answers where they were. The adapted target's features change as the
LoRA trains, so no feature cache can serve this run: every step runs the target twice (adapted
with gradient, original without).

The heads directory of a Medusa-2 run holds peft's `adapter_config.json` + `adapter_model.safetensors`
beside the heads, and its fingerprint names that adapter: loading the heads loads base + adapter.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from headstart.heads.losses import medusa_loss
from headstart.runtime.adapters import quiet_peft
from headstart.runtime.target import features
from headstart.train.config import ConfigError, HeadsConfig, LoraConfig
from headstart.train.features import hidden_states


class LoraTraining:
    """Medusa-2's hook in the trainer (`HeadKind.trains_target`): the target gets a fresh LoRA that trains with
    the heads, at its own learning rate, under `medusa2_loss`; evaluation reads the adapted target's features
    and reports its drift from the original (`drift/kl`); the LoRA is saved beside the heads."""

    def __init__(self, model: nn.Module, heads: nn.Module, cfg: HeadsConfig) -> None:
        self.target = attach_lora(model, cfg.lora)  # the peft model
        self.module = AdaptedTarget(self.target, heads)  # what trains: base + LoRA + heads
        self.param_group = {"params": [p for p in self.target.parameters() if p.requires_grad], "lr": cfg.lora.lr}
        self.lm_head = model.get_output_embeddings().weight  # (V, H), for the KL
        self.num_heads, self.kl_weight = cfg.num_heads, cfg.lora.kl_weight

    def loss(self, module: nn.Module, heads: nn.Module, batch: dict[str, torch.Tensor], tools) -> torch.Tensor:
        """`module`: the AdaptedTarget as Accelerate wrapped it; `tools`: the kind's Tools (readout, to_draft)."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        return medusa2_loss(
            module,
            heads,
            tools.readout,
            self.lm_head,
            ids,
            mask,
            batch["loss_mask"],
            self.num_heads,
            self.kl_weight,
            tools.to_draft,
        )

    @torch.no_grad()
    def eval_features(self, module: nn.Module, batch: dict[str, torch.Tensor]):
        """(the adapted target's features (B, T, H), {"drift/kl": (mean KL per token, tokens)})."""
        hidden, original = module(batch["input_ids"], batch["attention_mask"])
        mask = batch["loss_mask"]
        n = int(mask[:, 1:].sum())
        return hidden, ({"drift/kl": (drift_kl(hidden, original, self.lm_head, mask).item(), n)} if n else {})

    def save(self, folder: str | Path, base_name: str) -> str:
        """The LoRA into `folder`; its hash (the heads' fingerprint names it)."""
        return save_adapter(self.target, folder, base_name)


def attach_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """`model` as a peft model with a fresh LoRA (B = 0: it starts as the original); only the LoRA trains.
    No `target_modules`: every linear layer inside the decoder layers (peft's "all-linear"), on any family."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if cfg.r < 1:
        raise ConfigError(f"heads.lora needs r >= 1, got {cfg.r}")
    n_layers = model.config.num_hidden_layers
    bad = [i for i in cfg.layers if not 0 <= i < n_layers]
    if bad:
        raise ConfigError(f"heads.lora.layers {bad} out of range: the target has layers 0..{n_layers - 1}")
    config = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules) or "all-linear",
        layers_to_transform=list(cfg.layers) or None,
    )
    try:
        with quiet_peft():
            adapted = get_peft_model(model, config)
    except ValueError as e:  # modules the model does not have
        raise ConfigError(f"heads.lora: {str(e).splitlines()[0][:200]}") from e
    for p in adapted.parameters():  # the LoRA in float32 whatever the target's dtype
        if p.requires_grad:
            p.data = p.data.float()
    return adapted


class AdaptedTarget(nn.Module):
    """What a Medusa-2 run trains: the LoRA-adapted target and the heads, one module so that Accelerate
    prepares both at once (one DDP wrapper, one optimizer, one checkpoint). Its forward runs the target
    twice: (adapted features with gradient into the LoRA, original features without), (B, T, H) each."""

    def __init__(self, target: nn.Module, heads: nn.Module) -> None:
        super().__init__()
        self.target = target  # a peft model
        self.heads = heads

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        adapted = self._features(input_ids, attention_mask)
        with torch.no_grad(), self.target.disable_adapter():
            original = self._features(input_ids, attention_mask)
        return adapted, original

    def _features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return features(hidden_states(self.target, input_ids, attention_mask), (-1,)).float()  # (B, T, H)


def drift_kl(adapted: torch.Tensor, original: torch.Tensor, lm_head: torch.Tensor, loss_mask: torch.Tensor):
    """Medusa-2's self-distillation term from the two targets' features (B, T, H): mean KL(p || p') per
    position whose next token is a response token (`loss_mask[:, 1:]`), logits in float32 through the
    target's lm_head weight (V, H)."""
    valid = loss_mask[:, 1:]  # position t predicts token t + 1
    weight = lm_head.float()
    return self_distillation_kl(F.linear(adapted[:, :-1][valid], weight), F.linear(original[:, :-1][valid], weight))


def medusa2_loss(
    module: nn.Module,  # an AdaptedTarget, maybe DDP-wrapped: its forward is what DDP must see
    heads: nn.Module,  # its heads, unwrapped
    readout,  # the target's lm_head over the draft vocabulary, float32 (as for medusa_loss)
    lm_head: torch.Tensor,  # (V, H) the target's full lm_head weight, for the KL
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    num_heads: int,
    kl_weight: float,
    to_draft=None,
) -> torch.Tensor:
    """sum_k CE(head k on the ADAPTED target's features) + kl_weight * KL(original p || adapted p')."""
    adapted, original = module(input_ids, attention_mask)
    heads_loss = medusa_loss(heads, adapted, readout, input_ids, loss_mask, num_heads, to_draft)
    if not loss_mask[:, 1:].any():
        return heads_loss + adapted.sum() * 0
    return heads_loss + kl_weight * drift_kl(adapted, original, lm_head, loss_mask)


def self_distillation_kl(adapted_logits: torch.Tensor, original_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(p || p'): p = softmax(original_logits), the original target's next-token
    distribution, p' = softmax(adapted_logits), the adapted one's; (N, V) each. 0 when they agree."""
    log_p = original_logits.float().log_softmax(-1)
    log_q = adapted_logits.float().log_softmax(-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


def save_adapter(target: nn.Module, directory: str | Path, base_name: str) -> str:
    """Write the LoRA (peft's adapter_config.json + adapter_model.safetensors) into `directory`; its hash."""
    from headstart.runtime.adapters import adapter_sha

    directory = Path(directory)
    for config in target.peft_config.values():
        config.base_model_name_or_path = base_name  # the `--model` name, not the cache path it loaded from
    target.save_pretrained(str(directory), save_embedding_layers=False)
    (directory / "README.md").unlink(missing_ok=True)  # peft's empty model card template
    return adapter_sha(directory)
