"""EAGLE-3 head: k of the target's layers fused, one (or more) decoder layers, its own draft lm_head.

The forward both vLLM and SGLang run (../shared/ENGINES.md), written here once:

    u = fc(cat(h_1, ..., h_k))                               # (B, T, kH) -> (B, T, H), no bias
    x = cat(input_layernorm(embed(token)), hidden_norm(u))   # (B, T, 2H): q/k/v read 2H
    s = u + o_proj(attn(x))                                  # the residual is the un-normalised u
    y = s + mlp(post_attention_layernorm(s))
    y = layer_i(y) for each further draft layer              # plain Llama decoder layers (usually none)
    draft logits = lm_head(norm(y))                          # (B, T, N) over the draft vocabulary

h_1..h_k are the target's residual stream after the `feature_layers` (Hugging Face `output_hidden_states[k]`;
by default k = 3: layers 2, N//2 and N-3). At the next drafting step the head reads its own y in place of u
(fc is skipped). The draft layer is a Llama layer whatever the target is, sized like the target's layers; the
token embedding is the target's, frozen, and not part of the head.

Variants published heads use (speculators 0.9 writes each; all off by default):
- `norm_before_residual`: the first layer's residual is hidden_norm(u), not u (speculators' own heads).
- `norm_before_fc` (gpt-oss style): one RMSNorm `input_norm` over the concatenation, before fc.
- `fc_norm` (EAGLE 3.1): one RMSNorm per fused state, `fc_norm.i`, each on its own chunk, before fc.
- `norm_output` (EAGLE 3.1): y = norm(y) is what the next step reads, and the logits read it without a
  second norm: lm_head(y).
- `num_layers` > 1: further plain Llama decoder layers after the first.

Draft vocabulary: `lm_head` has one row per draft token; the buffer `draft_vocab` (N,) holds their
target ids, most frequent first (so a readout may keep only the first `limit` rows); exported, it
becomes the engines' `d2t` offsets (target id = i + d2t[i]) and `t2d` mask.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from headstart.heads.vocab import DraftReadout


def engine_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers vLLM and SGLang fuse by default: (2, N//2, N-3)."""
    return (2, num_layers // 2, num_layers - 3)


def feature_layers(num_layers: int) -> tuple[int, ...]:
    """The engines' layers, clamped into 1..N (ascending) for targets too shallow for them (test models)."""
    return tuple(sorted(min(max(k, 1), num_layers) for k in engine_feature_layers(num_layers)))


def _rope_parameters(config: PretrainedConfig) -> dict:
    """The target's rotary settings as a Llama layer takes them (full-attention ones when they differ per kind)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in rope:  # per attention kind (Gemma 3)
        rope = dict(rope["full_attention"])
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


def draft_config(target: PretrainedConfig, draft_vocab: int, layer: dict | None = None) -> LlamaConfig:
    """The draft layer's Llama config: the target's layer sizes, attention heads and rotary settings, but for
    what `layer` sets (a published head's own sizes, `LAYER_OVERRIDES`)."""
    hidden = target.hidden_size
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=target.intermediate_size,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=getattr(target, "num_key_value_heads", None) or target.num_attention_heads,
        head_dim=getattr(target, "head_dim", None) or hidden // target.num_attention_heads,
        rms_norm_eps=getattr(target, "rms_norm_eps", 1e-6),
        max_position_embeddings=target.max_position_embeddings,
        rope_parameters=_rope_parameters(target),
        vocab_size=target.vocab_size,
        num_hidden_layers=1,
        hidden_act="silu",
        tie_word_embeddings=False,
    )
    for key, value in (layer or {}).items():
        if key not in LAYER_OVERRIDES:
            raise ValueError(f"the draft layer's {key} cannot be set (settable: {', '.join(LAYER_OVERRIDES)})")
        setattr(config, key, value)
    config.draft_vocab_size = draft_vocab or target.vocab_size
    config._attn_implementation = "sdpa"  # takes the float tree masks drafting passes
    return config


# What a published head's layer may set differently from the target's layers.
LAYER_OVERRIDES = (
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_parameters",
)
LAYER_CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
    "vocab_size",
    "draft_vocab_size",
    "initializer_range",
)


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """transformers' LlamaDecoderLayer with EAGLE-3's two inputs (the token embedding and the fused state)."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool = False) -> None:
        super().__init__(config, layer_idx=0)
        self.norm_before_residual = norm_before_residual
        # --- change to LlamaDecoderLayer ------------------------------------------------------------
        # q/k/v read [input_layernorm(embed); hidden_norm(u)], 2H wide; a second input norm for u.
        hidden, attn = config.hidden_size, self.self_attn
        kv = config.num_key_value_heads * attn.head_dim
        attn.q_proj = nn.Linear(2 * hidden, config.num_attention_heads * attn.head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * hidden, kv, bias=False)
        attn.v_proj = nn.Linear(2 * hidden, kv, bias=False)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        # --------------------------------------------------------------------------------------------

    def forward(  # the fenced change: two inputs, the residual is u (LlamaDecoderLayer.forward otherwise)
        self,
        embeds: torch.Tensor,  # (B, T, H) embeddings of the tokens
        hidden: torch.Tensor,  # (B, T, H) u: fused target states, or the head's previous output
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **attention_kwargs,
    ) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # (B, T, 2H)
        residual = normed if self.norm_before_residual else hidden
        attn, _ = self.self_attn(
            hidden_states=x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=position_embeddings,
            **attention_kwargs,
        )
        s = residual + attn
        return s + self.mlp(self.post_attention_layernorm(s))


class Eagle3Head(nn.Module):
    def __init__(
        self,
        target: PretrainedConfig,
        draft_vocab: int = 0,
        layers: list[int] | None = None,
        norm_before_residual: bool = False,
        layer: dict | None = None,
        fc_norm: bool = False,
        norm_before_fc: bool = False,
        norm_output: bool = False,
        num_layers: int = 1,
    ) -> None:
        """`layers`: the fused target layers (default: the engines' three); `layer`: the draft layers' own sizes
        where they differ from the target's; the other options are the variants of the module docstring."""
        super().__init__()
        if draft_vocab > target.vocab_size:
            raise ValueError(f"a draft vocabulary of {draft_vocab} is larger than the target's {target.vocab_size}")
        if fc_norm and norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc are exclusive: a head norms its fused states one way")
        if num_layers < 1:
            raise ValueError(f"an EAGLE-3 head has at least one draft layer, got num_layers {num_layers}")
        self.config = draft_config(target, draft_vocab, layer)
        self.feature_layers = tuple(layers or feature_layers(target.num_hidden_layers))
        n = target.num_hidden_layers
        if len(self.feature_layers) < 2 or not all(1 <= k <= n for k in self.feature_layers):
            raise ValueError(f"EAGLE-3 fuses two or more target layers in 1..{n}, got {list(self.feature_layers)}")
        self.norm_output = norm_output
        hidden, k, eps = target.hidden_size, len(self.feature_layers), self.config.rms_norm_eps
        self.input_norm = LlamaRMSNorm(k * hidden, eps=eps) if norm_before_fc else None
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(hidden, eps=eps) for _ in range(k)) if fc_norm else None
        self.fc = nn.Linear(k * hidden, hidden, bias=False)
        self.midlayer = Eagle3DecoderLayer(self.config, norm_before_residual)
        self.extra_layers = nn.ModuleList(LlamaDecoderLayer(self.config, layer_idx=i) for i in range(1, num_layers))
        self.norm = LlamaRMSNorm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, self.config.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(self.config)
        # (N,) target ids of the lm_head's rows, set by training; None = the full vocabulary in order.
        self.register_buffer("draft_vocab", torch.zeros(draft_vocab, dtype=torch.long) if draft_vocab else None)

    def variant(self, changed_only: bool = False) -> dict:
        """The variant options this head was built with (saved with it; the export writes them); `changed_only`:
        those that differ from a plain EAGLE-3 head's (`PLAIN_VARIANT`)."""
        variant = {
            "norm_before_residual": self.midlayer.norm_before_residual,
            "fc_norm": self.fc_norm is not None,
            "norm_before_fc": self.input_norm is not None,
            "norm_output": self.norm_output,
            "num_layers": 1 + len(self.extra_layers),
        }
        return {k: v for k, v in variant.items() if not changed_only or PLAIN_VARIANT[k] != v}

    @classmethod
    def for_target(cls, model: nn.Module, **options) -> Eagle3Head:
        return cls(model.config, **options)

    def layer_config(self) -> dict:
        """The draft layer's Llama config as plain JSON values (saved with the heads, read by the export)."""
        config = self.config.to_dict()
        return {k: config[k] for k in LAYER_CONFIG_KEYS if k in config}

    def init_lm_head(self, target_lm_head: nn.Module) -> None:
        """Start the draft lm_head from the target's rows of the draft tokens (set `draft_vocab` first)."""
        weight = target_lm_head.weight.detach()
        rows = weight if self.draft_vocab is None else weight[self.draft_vocab.to(weight.device)]
        self.lm_head.weight.data.copy_(rows)

    def readout(self, target_lm_head: nn.Module | None = None, limit: int | None = None) -> DraftReadout:
        """norm (unless the output is normed already) + the head's own lm_head, over its first `limit` draft tokens
        (the target's lm_head is unused)."""
        return DraftReadout(self.lm_head.weight, self.draft_vocab, limit, norm=None if self.norm_output else self.norm)

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, kH) the target's fused states -> (B, T, H) u: the norms of the variant, then fc."""
        if self.input_norm is not None:
            hidden = self.input_norm(hidden)
        if self.fc_norm is not None:
            chunks = hidden.chunk(len(self.fc_norm), dim=-1)
            hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(hidden)

    def forward(
        self,
        hidden: torch.Tensor,  # (B, T, kH) target states at t (fused by fc), or (B, T, H) the head's own y
        next_embeds: torch.Tensor,  # (B, T, H) embeddings of tokens t+1
        position_ids: torch.Tensor,  # (B, T)
        attention_mask: torch.Tensor | None = None,  # None = causal; else a float 4D mask (B, 1, T, past+T)
        cache=None,
        **attention_kwargs,  # to the attention function (runtime/attention.py: `packing`)
    ) -> torch.Tensor:
        """y (B, T, H): the draft layers' output (normed with `norm_output`), the next step's `hidden`."""
        u = self.fuse(hidden) if hidden.shape[-1] == self.fc.in_features else hidden
        cos_sin = self.rotary(u, position_ids)
        y = self.midlayer(next_embeds.to(u.dtype), u, attention_mask, position_ids, cache, cos_sin, **attention_kwargs)
        for layer in self.extra_layers:
            y = layer(
                y,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
                position_embeddings=cos_sin,
                **attention_kwargs,
            )
        return self.norm(y) if self.norm_output else y

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., N) draft logits over every draft token."""
        return self.lm_head(y if self.norm_output else self.norm(y))


# the flags published configs write for the variants (both export layouts and the readers use these names)
VARIANT_FLAGS = ("fc_norm", "norm_before_fc", "norm_output")
# a plain EAGLE-3 head's variant options: the constructor's defaults, written once there
PLAIN_VARIANT = {
    k: p.default
    for k, p in inspect.signature(Eagle3Head.__init__).parameters.items()
    if k in ("norm_before_residual", *VARIANT_FLAGS, "num_layers")
}
