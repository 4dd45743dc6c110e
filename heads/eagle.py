"""EAGLE head: one decoder layer of the target's own architecture that predicts the next feature.

Input at position t: [embed(token t+1); feature(t)] -> fc (2H -> H) -> one decoder layer built from
the target's decoder-layer class and config -> predicted feature(t+1), read out by the target's
frozen lm_head.

Which feature: the target's final hidden state AFTER its final norm (the last entry of
`output_hidden_states`, what `Target.verify` returns). It is what the lm_head reads, so the
predicted feature needs no further norm, it exists under that name in every Hugging Face causal
LM, and its scale is stable (std ~2 on SmolLM2, against ~70 before the norm), which keeps the
SmoothL1 regression well conditioned.

With `draft_vocab` N > 0 the readout is restricted to the N ids in the buffer `draft_vocab`
(`heads.vocab`); the feature regression does not depend on it.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import PretrainedConfig

from headstart.heads.vocab import DraftReadout


class EagleHead(nn.Module):
    feature_layers = (-1,)  # the target hidden states it reads: the last one (after the final norm)

    def __init__(
        self,
        config: PretrainedConfig,
        layer_cls: type[nn.Module],
        rotary_cls: type[nn.Module],
        draft_vocab: int = 0,
        fc_bias: bool = True,
    ) -> None:
        """`fc_bias`: False for heads published without one (the EAGLE authors' config `"bias": false`)."""
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layer = layer_cls(config, layer_idx=0)
        # --- change to the target's decoder layer (as EAGLE does) ----------------------------------
        # The fc output feeds attention directly: the first input norm is dropped (post-norm layers such
        # as OLMo-2's have none to drop).
        if hasattr(self.layer, "input_layernorm"):
            self.layer.input_layernorm = nn.Identity()
        # --------------------------------------------------------------------------------------------
        self.rotary = rotary_cls(config)
        # rotary embeddings per attention kind (Gemma 3: local and global) take the layer's kind
        takes_kind = "layer_type" in inspect.signature(rotary_cls.forward).parameters
        self.rotary_kwargs = {"layer_type": config.layer_types[0]} if takes_kind else {}  # the kind of layer 0
        # (N,) target ids of the draft vocabulary, set by training; None = the full vocabulary.
        self.register_buffer("draft_vocab", torch.zeros(draft_vocab, dtype=torch.long) if draft_vocab else None)

    @staticmethod
    def check_target(model: nn.Module) -> None:
        """Refuse, in one line naming the model class, a target whose decoder layout the head cannot reuse."""
        decoder = model.get_decoder()
        layers = getattr(decoder, "layers", None)
        missing = [
            what
            for what, ok in (
                ("a decoder layer list", layers is not None),
                ("a rotary embedding", hasattr(decoder, "rotary_emb")),
                (
                    "a decoder layer that takes `cache=`",
                    layers is not None and "cache" in inspect.signature(type(layers[0]).forward).parameters,
                ),
            )
            if not ok
        ]
        if missing:
            raise ValueError(f"EAGLE heads cannot be built for {type(model).__name__}: it lacks {', '.join(missing)}")

    @classmethod
    def for_target(cls, model: nn.Module, draft_vocab: int = 0, fc_bias: bool = True) -> EagleHead:
        """Build from a Hugging Face causal LM: its config, decoder-layer class and rotary embedding class."""
        cls.check_target(model)
        decoder = model.get_decoder()
        return cls(model.config, type(decoder.layers[0]), type(decoder.rotary_emb), draft_vocab, fc_bias)

    def readout(self, target_lm_head: nn.Module, limit: int | None = None) -> DraftReadout:
        """The target's lm_head over this checkpoint's draft vocabulary (its `limit` most frequent tokens)."""
        return DraftReadout(target_lm_head, self.draft_vocab, limit)

    def forward(
        self,
        features: torch.Tensor,  # (B, T, H) target features at t
        next_embeds: torch.Tensor,  # (B, T, H) embeddings of tokens t+1
        position_ids: torch.Tensor,  # (B, T)
        attention_mask: torch.Tensor | None = None,  # None = causal; else a float 4D mask (B, 1, T, past+T)
        cache=None,
        **attention_kwargs,  # to the attention function (runtime/attention.py: `packing`)
    ) -> torch.Tensor:
        """Predicted features at t+1, (B, T, H)."""
        x = self.fc(torch.cat([next_embeds, features], dim=-1))
        cos_sin = self.rotary(x, position_ids, **self.rotary_kwargs)
        return self.layer(
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            position_embeddings=cos_sin,
            cache=cache,
            use_cache=cache is not None,
            **attention_kwargs,
        )
