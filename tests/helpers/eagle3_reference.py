"""An EAGLE-3 head's drafting written out with plain tensor operations, from its weights alone.

Independent of `heads/eagle3.py` (no transformers layer is called): what the variants of the module docstring,
as speculators 0.9 defines them, compute. Used to check the head's own forward.
"""

from __future__ import annotations

import torch


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding of x (heads, T, d) at `positions` (T,)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions[:, None].double() * inv[None]  # (T, d/2)
    cos, sin = torch.cat([angles, angles], -1).cos().to(x), torch.cat([angles, angles], -1).sin().to(x)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


class Layer:
    """One decoder layer's attention + MLP, its keys and values kept across calls (a KV cache)."""

    def __init__(self, w: dict, prefix: str, cfg) -> None:
        self.w, self.p, self.cfg = w, prefix, cfg
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def attend(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (T, in) new entries at `positions`; each sees every earlier entry and itself (causal over them)."""
        w, p, c = self.w, self.p, self.cfg
        nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        theta = c.rope_parameters["rope_theta"]
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(len(x), nh, d).transpose(0, 1)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(len(x), nkv, d).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(len(x), nkv, d).transpose(0, 1)
        q, k = rotate(q, positions, theta), rotate(k, positions, theta)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], 1)
        self.values = v if self.values is None else torch.cat([self.values, v], 1)
        keys = self.keys.repeat_interleave(nh // nkv, 0)
        values = self.values.repeat_interleave(nh // nkv, 0)
        scores = q @ keys.transpose(1, 2) / d**0.5  # (nh, T, past + T)
        past = keys.shape[1] - len(x)
        causal = torch.ones(len(x), keys.shape[1], dtype=torch.bool).tril(past)
        out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ values  # (nh, T, d)
        return out.transpose(0, 1).reshape(len(x), nh * d) @ w[p + "self_attn.o_proj.weight"].T

    def mlp(self, s: torch.Tensor) -> torch.Tensor:
        w, p, eps = self.w, self.p, self.cfg.rms_norm_eps
        h = rms(s, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        return s + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


class ReferenceEagle3:
    """Draft logits of an EAGLE-3 head: `commit` the target's fused states of a prefix, then `step` with the
    head's own output, as drafting does."""

    def __init__(self, head) -> None:
        self.w = {k: v.detach().double() for k, v in head.state_dict().items()}
        self.cfg, self.variant = head.config, head.variant()
        self.k = len(head.feature_layers)
        self.layers = [Layer(self.w, "midlayer.", self.cfg)]
        self.layers += [Layer(self.w, f"extra_layers.{i}.", self.cfg) for i in range(self.variant["num_layers"] - 1)]

    def fuse(self, h: torch.Tensor) -> torch.Tensor:
        w, eps = self.w, self.cfg.rms_norm_eps
        if self.variant["norm_before_fc"]:
            h = rms(h, w["input_norm.weight"], eps)
        if self.variant["fc_norm"]:
            h = torch.cat([rms(c, w[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(h.chunk(self.k, -1))], -1)
        return h @ w["fc.weight"].T

    def _run(self, u: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the next step's input, draft logits) of entries u (T, H) with the embeddings of their next tokens."""
        w, eps = self.w, self.cfg.rms_norm_eps
        first = self.layers[0]
        normed = rms(u, w["midlayer.hidden_norm.weight"], eps)
        x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"], eps), normed], -1)
        s = (normed if self.variant["norm_before_residual"] else u) + first.attend(x, positions)
        y = first.mlp(s)
        for layer in self.layers[1:]:
            y = layer.mlp(y + layer.attend(rms(y, w[layer.p + "input_layernorm.weight"], eps), positions))
        final = rms(y, w["norm.weight"], eps)
        return (final if self.variant["norm_output"] else y), final @ w["lm_head.weight"].T

    def commit(self, fused: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix: fused (T, kH) target states at 0..T-1, embeds (T, H) of tokens 1..T."""
        return self._run(self.fuse(fused.double()), embeds.double(), torch.arange(len(fused)))

    def step(self, previous: torch.Tensor, embed: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step: the head's own last output (H,) with the drafted token's embedding (H,)."""
        return self._run(previous.double()[None], embed.double()[None], torch.tensor([position]))
