"""The fast path's decoder stack: a Llama-style target's forward with fused weights and few dispatches.

At batch size 1 a forward of a small model is not bound by its weights but by the ~600 small operations
transformers dispatches for it (a per-op profile of SmolLM2-135M: docs/tuning.md, "The fused forward"). Here
the same layers run with:

- one product for q, k and v (their weights concatenated, then prepacked: runtime/kernels.py), one for gate and
  up; the modules' own weights become views of the fused ones, so nothing is held twice and the module names
  (peft, training, export) stay;
- rotary applied to q and k together, in the order transformers applies it (the same roundings);
- keys and values written straight into the slot cache (runtime/kvcache.py) and attended by `grouped_sdpa`
  (runtime/attention.py), with the caller's float tree masks and `Packing` as they are;
- only the hidden states asked for kept, and logits only for the rows asked for.

Which models: a decoder whose layers are Llama's (`LlamaForCausalLM`: SmolLM, Llama), Qwen2's (q/k/v biases)
or Qwen3's (q/k norms), and Mistral's without a sliding window, all with full attention on every layer (a
windowed model keeps transformers' forward: its masks are per layer) and no live LoRA (peft's wrappers: the
generic path). `FusedStack.refusal(model)` says why a model keeps the generic path; the caller uses it
silently, as every other model does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from headstart.heads.masks import additive_mask, causal_after
from headstart.runtime import native
from headstart.runtime.attention import AttentionLayout, Packing, grouped_sdpa
from headstart.runtime.kernels import PackedLinear, live_lora, own_kind, packings

FUSED_TYPES = ("llama", "qwen2", "qwen3", "mistral")  # config.model_type the fused stack runs


@dataclass
class FusedOutput:
    logits: torch.Tensor  # (B, kept rows, V)
    hidden_states: list[torch.Tensor | None]  # as transformers' output_hidden_states: L + 1 entries, None unasked


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, kind: str) -> nn.Module:
    """x -> x @ weight.T + bias, prepacked as `kind` ("none": the stock kernel)."""
    kind = own_kind(weight, kind)
    if kind != "none":
        return PackedLinear.from_weight(weight, bias, kind)
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)
    linear.out_features, linear.in_features = weight.shape
    linear.weight, linear.bias = nn.Parameter(weight, requires_grad=False), bias
    return linear


def _fuse(modules: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the modules' weights (and biases) along their outputs; each module's weight (and bias) becomes a
    view of the fused tensor (frozen: the target never trains), so the memory is held once."""
    weight = torch.cat([m.weight.detach() for m in modules])
    biased = [m.bias is not None for m in modules]
    if any(biased) and not all(biased):
        raise ValueError("fused projections must all have a bias or none")
    bias = torch.cat([m.bias.detach() for m in modules]) if all(biased) else None
    start = 0
    for m in modules:
        n = m.out_features
        m.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return weight, bias


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """`norm` (a Llama-style RMSNorm: `weight`, `variance_epsilon`) of `x`, in its roundings (normalised in float32,
    rounded to x's dtype, then scaled) with half its dispatches."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon).to(x.dtype)
    return norm.weight * normed


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """`sin` (..., D) with its first half negated: rotate_half(x) * sin == roll(x, D/2) * signed_sin(sin), the form
    the fused layers and the native kernel apply rotary in."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


class FusedLayer:
    """One decoder layer's fused weights and norms (the layer's own modules, read, never copied)."""

    def __init__(self, layer: nn.Module, config, kind: str) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.head_dim = attn.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.scaling = attn.scaling
        self.layer_idx = attn.layer_idx
        self.qkv = _linear(*_fuse([attn.q_proj, attn.k_proj, attn.v_proj]), kind)
        self.q_norm = getattr(attn, "q_norm", None)  # Qwen3: an RMSNorm over each head's dims, before rotary
        self.k_norm = getattr(attn, "k_norm", None)
        self.gate_up = _linear(*_fuse([mlp.gate_proj, mlp.up_proj]), kind)
        self.intermediate = mlp.gate_proj.out_features
        self.act = mlp.act_fn
        self.mlp = mlp  # o_proj and down_proj are read from their modules at each call (a repack swaps them)
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm

    def repack(self, kind: str) -> None:
        """Prepack the fused products again as `kind`."""
        self.qkv = _linear(self.qkv.weight.detach(), self.qkv.bias, kind)
        self.gate_up = _linear(self.gate_up.weight.detach(), self.gate_up.bias, kind)

    def __call__(self, h, cos, sin, mask, cache, packing) -> torch.Tensor:
        B, q, _ = h.shape
        H, G, D = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(rms_norm(h, self.input_norm)).view(B, q, H + 2 * G, D)  # (B, q, H + 2G, D)
        qk, v = qkv[:, :, : H + G], qkv[:, :, H + G :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
        qk = qk * cos + qk.roll(D // 2, -1) * sin  # rotary on q and k at once (`sin` signed): (B, q, H + G, D)
        query = qk[:, :, :H].transpose(1, 2)  # (B, H, q, D)
        key, value = cache.update(qk[:, :, H:].transpose(1, 2), v.transpose(1, 2), self.layer_idx)  # (B', G, k, D)
        out, _ = grouped_sdpa(self.attn, query, key, value, mask, scaling=self.scaling, packing=packing)  # (B, q, H, D)
        h = h + self.attn.o_proj(out.reshape(B, q, H * D))
        gate_up = self.gate_up(rms_norm(h, self.post_norm))  # (B, q, 2I)
        act = self.act(gate_up[..., : self.intermediate]) * gate_up[..., self.intermediate :]
        return h + self.mlp.down_proj(act)


class FusedStack:
    """A supported model's forward (see the module docstring), built once over its modules."""

    def __init__(self, model: nn.Module, kind: str) -> None:
        """`kind`: how the fused products are prepacked (runtime/kernels.py: "onednn", "mkl" or "none")."""
        self.model = model
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = inner.norm
        self.layers = [FusedLayer(layer, model.config, kind) for layer in inner.layers]
        self._native: tuple[int, native.Layers | None] | None = None  # native_layers() at kernels.packings()
        self.fused_modules = frozenset(
            id(m)
            for layer in inner.layers
            for m in (
                layer.self_attn.q_proj,
                layer.self_attn.k_proj,
                layer.self_attn.v_proj,
                layer.mlp.gate_proj,
                layer.mlp.up_proj,
            )
        )

    def repack(self, kind: str) -> None:
        for layer in self.layers:
            layer.repack(kind)
        self._native = None

    def native_layers(self) -> native.Layers | None:
        """The layers' weights as the native forward reads them (runtime/native.py), or None where any product of
        theirs is not packed for it (the stack then runs in Python); built at first use, after the caller packed
        the modules the stack reads from the model (o_proj, down_proj), and again whenever `prepack_linears` has
        swapped modules since (`kernels.packings`)."""
        packing = packings()
        if self._native is None or self._native[0] != packing:
            self._native = (packing, native.layers(self.layers))
        return self._native[1]

    @staticmethod
    def config_refusal(config) -> str | None:
        """Why decoder layers of `config` are not ones the fused stack runs (None: they are)."""
        if config.model_type not in FUSED_TYPES:
            return f"model type {config.model_type!r} (the fused stack runs {', '.join(FUSED_TYPES)})"
        if AttentionLayout(config).window is not None:
            return "sliding-window attention"
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            return f"activation {config.hidden_act!r}"
        if getattr(config, "mlp_bias", False):
            return "MLP biases"
        return None

    @staticmethod
    def refusal(model: nn.Module) -> str | None:
        """Why `model` keeps transformers' forward, or None where the fused stack runs it."""
        why = FusedStack.config_refusal(model.config)
        if why is not None:
            return why
        if live_lora(model):
            return "a live LoRA adapter"
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "norm", "layers")):
            return "an unexpected module layout"
        if not hasattr(inner.norm, "variance_epsilon"):
            return f"its norm ({type(inner.norm).__name__}) is not Llama's RMSNorm"
        return None

    def __call__(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
        cache,
        hidden_wanted: bool | list[int],
        logits_to_keep: int | torch.Tensor = 0,
        packing: Packing | None = None,
    ) -> FusedOutput:
        """The model's forward over `ids` (B, q) at `positions` (B, q) with the float 4D `mask` (None: causal after
        the cache, as the model's own), the slot `cache` fed beforehand; hidden states as `output_hidden_states`
        (True: all, a list: those indices); logits of the last `logits_to_keep` rows (0: all; a tensor: those)."""
        h = self.embed(ids)  # (B, q, H)
        n = len(self.layers)
        wanted = set(range(n + 1)) if hidden_wanted is True else set(hidden_wanted or ())
        wanted = {k % (n + 1) for k in wanted}
        cos, sin = self.rotary(h, positions)  # (B, q, D)
        sin = signed_sin(sin)
        table = self.native_layers()
        if table is not None:
            hidden, h = native.forward(self, table, h, mask, cos, sin, cache, wanted, packing)
        else:
            hidden, h = self._layers(h, mask, cos, sin, cache, wanted, packing)
        rows = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        # the lm_head read from the model at each call: prepacking swaps it after the stack is built
        return FusedOutput(self.model.get_output_embeddings()(h[:, rows]), hidden)

    def _layers(self, h, mask, cos, sin, cache, wanted: set[int], packing) -> tuple[list, torch.Tensor]:
        """The decoder layers and the final norm in Python (where the native forward does not run): the hidden
        states `wanted` and the final norm's output."""
        q = h.shape[1]
        if mask is None and q > 1:  # a prefill chunk: causal over the slot's cached rows, as the model's own mask
            past = cache.starts[0]  # the fed slot's first new row (no sync: the cache's bookkeeping)
            mask = additive_mask(causal_after(past, q), h.dtype, h.device)
        cos, sin = cos[:, :, None], sin[:, :, None]  # (B, q, 1, D): every head
        n = len(self.layers)
        hidden: list[torch.Tensor | None] = [None] * (n + 1)
        if 0 in wanted:
            hidden[0] = h
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask, cache, packing)
            if i + 1 in wanted and i + 1 < n:
                hidden[i + 1] = h
        h = rms_norm(h, self.norm)
        if n in wanted:
            hidden[n] = h
        return hidden, h
