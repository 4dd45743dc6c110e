"""Target: a frozen Hugging Face causal LM with a KV cache that verifies draft trees.

Cache convention: the cache holds every token of the sequence except the last one, the *root*.
Each round feeds the root plus the draft tree in one forward (`verify`), then keeps the root and
the accepted nodes in the cache (`commit`); the correction/bonus token becomes the next root.
Plain decoding is the same round with an empty tree: one forward over the root.
No modeling file is copied: the model's own forward runs with a float 4D tree mask and explicit
position ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from headstart.runtime.attention import AttentionLayout
from headstart.runtime.tree import DraftTree, tree_visibility


@dataclass
class Verified:
    logits: torch.Tensor  # (n+1, V) target logits at the root and at every node
    hidden: torch.Tensor  # (n+1, F) the drafter's features at the same positions (`features`)


def features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """The hidden states `layers` names (indices into `output_hidden_states`: k = after k decoder layers,
    -1 = the last, after the final norm), concatenated: (..., len(layers) * H)."""
    if layers == (-1,):
        return hidden_states[-1]
    return torch.cat([hidden_states[k] for k in layers], dim=-1)


class Target:
    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval().requires_grad_(False)
        self.device = model.device
        self.dtype = model.dtype
        self.max_len = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.layout = AttentionLayout(model.config)
        self.cache = DynamicCache()  # full on every layer, sliding-window ones too (runtime/attention.py)

    @property
    def past_len(self) -> int:
        """Tokens committed to the KV cache."""
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], layers: tuple[int, ...] = (-1,)) -> torch.Tensor | None:
        """Start a new sequence: cache `token_ids` (every prompt token but the last, the first root).

        Returns their features (len, F) from the hidden states `layers`, or None when there are none.
        """
        self.cache = DynamicCache()
        if not token_ids:
            return None
        ids = torch.tensor([token_ids], device=self.device)
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, output_hidden_states=True, logits_to_keep=1)
        return features(out.hidden_states, layers)[0]

    @torch.inference_mode()
    def verify(self, root: int, tree: DraftTree, layers: tuple[int, ...] = (-1,)) -> Verified:
        """Score the root and every node of `tree` in one forward; the cache grows by len(tree) + 1."""
        past = self.past_len
        ids = torch.tensor([[root, *tree.tokens]], device=self.device)  # (1, n+1)
        if len(tree):
            allowed, positions = tree_visibility(tree, past)  # (n+1, past+n+1), (n+1,)
            mask = self.layout.masks(allowed, positions, past, self.dtype, self.device)
            positions = positions[None].to(self.device)
        else:  # plain decoding step: one query, the model masks it as its own forward would
            mask, positions = None, torch.tensor([[past]], device=self.device)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=True,
        )
        return Verified(logits=out.logits[0], hidden=features(out.hidden_states, layers)[0])

    def commit(self, n_fed: int, path: list[int]) -> None:
        """After a verify that fed `n_fed` = len(tree) + 1 tokens, keep the root and the accepted `path`."""
        drop = n_fed - 1 - len(path)
        if path == list(range(len(path))):  # accepted nodes lie right after the root: just crop the tail
            if drop:
                self.cache.crop(-drop)
            return
        root_pos = self.past_len - n_fed
        nodes = torch.tensor(path, device=self.device) + root_pos + 1
        keep = torch.cat([torch.arange(root_pos + 1, device=self.device), nodes])  # prefix, root, path
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)
