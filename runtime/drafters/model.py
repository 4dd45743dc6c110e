"""Draft-model drafters: a small causal LM with the target's tokenizer drafts a chain of guesses.

`ModelDrafter` runs any Hugging Face causal LM autoregressively with its own KV cache. Its cache is
kept in sync with the sequence by prefix: each round it keeps the longest common prefix of what it
holds and the context (the accepted draft tokens are already in it), crops the rest and feeds what
is new, the root last.

Chain (the default, top_k = 1): at temperature 0 its greedy chain (point masses); at temperature > 0
it SAMPLES each token from its own distribution q — the target's temperature / top-k / top-p applied
to the draft's logits — and records q per node, so verification accepts with min(1, p/q).
Tree (top_k > 1): the EAGLE-2 dynamic tree over the draft model's own log-probabilities — depth by
depth the `top_k` best frontier nodes (by cumulative log-probability) are expanded in one draft
forward with a tree mask over its cache, each gets its `top_k` likeliest children, and the best
`budget` nodes are kept. Every tree node is a deterministic guess (a point mass), at any temperature.

`layerskip_model` makes the draft model out of the target itself: its first N decoder layers (or a
chosen subset containing layer 0), then its final norm and lm_head. No weights are copied and the
draft's KV cache is its own.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn
from transformers import DynamicCache

from headstart.heads.masks import additive_mask
from headstart.runtime.drafters.base import SamplingDrafter
from headstart.runtime.drafters.options import TreeOptions
from headstart.runtime.sampling import SamplingParams, draw, target_probs
from headstart.runtime.tree import DraftTree, TreeGrower


class TokenizerMismatchError(ValueError):
    """The draft model does not speak the target's tokenizer."""


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Refuse a draft model whose vocabulary differs from the target's in size or in any token string."""
    a, b = target_tok.get_vocab(), draft_tok.get_vocab()
    if a == b:
        return
    if len(a) != len(b):
        detail = f"{len(a)} vs {len(b)} tokens"
    else:
        token, i = next((t, i) for t, i in sorted(a.items(), key=lambda kv: kv[1]) if b.get(t) != i)
        detail = f"token {token!r} is id {i} in {target_name} but {b.get(token)} in {draft_name}"
    raise TokenizerMismatchError(
        f"draft model {draft_name} does not share the tokenizer of the target {target_name} ({detail})"
    )


def layerskip_model(model: nn.Module, layers: list[int]) -> nn.Module:
    """A view of `model` that runs only decoder `layers` (sharing their weights), then its norm and lm_head."""
    decoder = model.get_decoder()
    if not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise ValueError(f"the layerskip drafter cannot run {type(model).__name__}: its decoder has no `layers` list")
    total = len(decoder.layers)
    if not layers or layers[0] != 0 or any(b <= a for a, b in itertools.pairwise(layers)):
        raise ValueError(f"draft layers must be increasing and start at layer 0, got {layers}")
    if layers[-1] >= total:
        raise ValueError(f"the target has {total} layers (0..{total - 1}), got layer {layers[-1]}")
    config = copy.deepcopy(model.config)
    if getattr(config, "layer_types", None):  # per-layer attention kinds (sliding / full) of the kept layers
        config.__dict__["layer_types"] = [config.layer_types[i] for i in layers]  # validated with the count below
    config.num_hidden_layers = len(layers)  # the decoder runs layers[:num_hidden_layers]
    config.use_cache = False  # a cache built from this config would not know the layers' own indices
    # --- shallow copies: new module containers, the same parameters -------------------------------
    shallow_decoder = copy.copy(decoder)
    shallow_decoder._modules = dict(decoder._modules)
    shallow_decoder.layers = nn.ModuleList(decoder.layers[i] for i in layers)
    shallow_decoder.config = config
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft.config = config
    setattr(draft, model.base_model_prefix, shallow_decoder)
    # ------------------------------------------------------------------------------------------------
    return draft


class LayerSubsetCache(DynamicCache):
    """The KV cache of a layer-skip view: its layers keep their original indices (0, 2, 5, ...), which
    this cache maps to its own slots 0, 1, 2, ... The target's layers are shared, so they cannot be
    renumbered."""

    def __init__(self, layers: list[int]) -> None:
        super().__init__()
        self.slot = {layer: i for i, layer in enumerate(layers)}

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return super().update(key_states, value_states, self.slot[layer_idx], *args, **kwargs)


class ModelDrafter(SamplingDrafter):
    name = "model"

    def __init__(
        self,
        model: nn.Module,
        options: TreeOptions | None = None,
        vocab_size: int | None = None,
        layers: list[int] | None = None,
    ) -> None:
        """top_k = 1: a chain of `depth`; > 1: a tree of at most `budget` nodes. `layers`: the original
        indices of a layer-skip view's layers (`layerskip_model`: the drafter is "layerskip"), None for a real
        model."""
        if layers is not None:
            self.name = "layerskip"
        o = options or TreeOptions()
        super().__init__(model.device)
        self.model, self.depth, self.top_k, self.budget, self.layers = model, o.depth, o.top_k, o.budget, layers
        self.vocab_size = vocab_size or model.config.vocab_size  # the target's V: q rows have this length
        self.max_len = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self._reset()

    @classmethod
    def layerskip(cls, target: nn.Module, layers: list[int], options: TreeOptions | None = None) -> ModelDrafter:
        """Draft with the target's own decoder `layers` (increasing, from layer 0), norm and lm_head."""
        return cls(layerskip_model(target, layers), options, layers=layers)

    def clear(self) -> None:
        super().clear()
        self._reset()

    def _reset(self) -> None:
        self.cache = LayerSubsetCache(self.layers) if self.layers is not None else DynamicCache()
        self.cached: list[int] = []  # the tokens whose K/V the draft cache holds
        self.agreed = 0  # a prefix of the context known to equal the start of `cached`

    def start(self, prompt_ids, prompt_hidden, sampling: SamplingParams | None = None, seed: int | None = None):
        self._reset()
        self.start_sampling(sampling, seed)

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V_draft) -> (..., V_target): rows past the tokenizer's ids are padding; missing ones -inf."""
        V = self.vocab_size
        if logits.shape[-1] >= V:
            return logits[..., :V]
        pad = logits.new_full((*logits.shape[:-1], V - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Append `tokens` to the draft cache; the draft's logits after the last one, (V_target,)."""
        ids = torch.tensor([tokens], device=self.model.device)
        logits = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        self.cached += tokens
        return self._to_target_vocab(logits)

    @torch.inference_mode()
    def propose(self, context: list[int]) -> DraftTree:
        if len(context) + self.depth > self.max_len:
            return DraftTree()
        logits = self._sync(context)
        return self._draft_chain(logits) if self.top_k == 1 else self._draft_tree(logits)

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Bring the draft cache to `context` (all of it, the root last); the draft's logits after the root."""
        # Within a sequence the context only grows, so its first `agreed` tokens still match the cache:
        # compare only past them (not the whole prefix every round).
        limit = min(len(self.cached), len(context) - 1)  # the root is always fed: its logits are needed
        keep = min(self.agreed, limit)
        while keep < limit and self.cached[keep] == context[keep]:
            keep += 1
        if keep < len(self.cached):
            self.cache.crop(keep - len(self.cached))
            self.cached = self.cached[:keep]
        logits = self._feed(context[keep:])
        self.agreed = len(context)
        return logits

    def _draft_chain(self, logits: torch.Tensor) -> DraftTree:
        """`depth` tokens, each fed back: greedy, or sampled from q (recorded) at temperature > 0."""
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for step in range(self.depth):
            if self.sampling.greedy:
                tokens.append(int(logits.argmax()))
            else:
                q = target_probs(logits, self.sampling)  # (V,) the distribution really sampled from
                tokens.append(int(draw(q[None], self.generator)[0]))
                rows.append(q)
            if step < self.depth - 1:
                logits = self._feed(tokens[-1:])
        return DraftTree(tokens, list(range(-1, self.depth - 1)), torch.stack(rows) if rows else None)

    def _draft_tree(self, root_logits: torch.Tensor) -> DraftTree:
        """EAGLE-2's dynamic tree over the draft model's log-probabilities (point masses); see the module doc."""
        past = len(self.cached)  # the context: the root sits at position past - 1
        dtype, device = self.model.dtype, self.model.device
        grow = TreeGrower(self.top_k, self.budget)
        frontier = grow.add_children([-1], root_logits[None])
        for depth in range(1, self.depth):  # expand nodes at `depth`: their children are at depth + 1
            expand, allowed = grow.expand(frontier, past)  # allowed: (m, past + drafted)
            if not expand:
                break
            out = self.model(
                input_ids=torch.tensor([[grow.tokens[n] for n in expand]], device=device),
                attention_mask=additive_mask(allowed, dtype, device),  # (1, 1, m, past + drafted) float
                position_ids=torch.full((1, len(expand)), past - 1 + depth, device=device),
                cache=self.cache,
                use_cache=True,
            )
            logits = self._to_target_vocab(out.logits[0])  # (m, V)
            frontier = grow.add_children(expand, logits)
        if grow.n_drafted:
            self.cache.crop(-grow.n_drafted)  # drafted entries never stay in the draft cache
        return grow.tree()
