"""EAGLE drafter: the EAGLE head runs autoregressively on features and drafts a dynamic tree (EAGLE-2).

The head's own KV cache holds one entry per committed pair (feature(t), token(t+1)) at position t,
built from the target's true features; its output at the last pair is the predicted feature at
the root, whose lm_head readout scores the root's children. Drafting, depth by depth: score every
frontier node by the cumulative log-probability of its path, expand the `top_k` best (one head
forward over all of them, a tree mask inside the head), give each its `top_k` likeliest children.
Then rerank every drafted node by cumulative log-probability and keep the best `budget`: a child is
never likelier than its parent, so the kept set is a tree. Drafted entries leave the head's cache
after each round; the features of the accepted path, from the target's verification pass, enter it.
Every node is a deterministic guess (a point mass). Heads trained with a reduced draft vocabulary
score only its tokens (`heads.vocab`); log-probabilities are then normalised over those.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from heads.eagle import EagleHead
from runtime.drafters import Drafter
from runtime.tree import DraftTree, rerank


def _mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q, k) bool -> float 4D additive mask (1, 1, q, k)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


class EagleDrafter(Drafter):
    name = "eagle"

    def __init__(
        self, head: EagleHead, embed: nn.Module, lm_head: nn.Module, depth: int = 5, top_k: int = 4, budget: int = 16
    ) -> None:
        if min(depth, top_k, budget) < 1:
            raise ValueError(f"depth, top_k and budget must be >= 1, got {depth}, {top_k}, {budget}")
        self.head, self.embed, self.readout = head, embed, head.readout(lm_head)
        self.depth, self.top_k, self.budget = depth, top_k, budget
        self.cache = DynamicCache()
        self._root_feature: torch.Tensor | None = None  # (H,) predicted feature at the root's position

    @property
    def _committed(self) -> int:
        return self.cache.get_seq_length()

    def _run_head(self, features: torch.Tensor, tokens: list[int], positions: torch.Tensor, allowed: torch.Tensor):
        """Append len(tokens) entries to the head's cache; (n, H) predicted next features."""
        device = features.device
        embeds = self.embed(torch.tensor(tokens, device=device))
        mask = _mask(allowed.to(device), features.dtype)
        out = self.head(features[None], embeds[None], positions[None].to(device), mask, cache=self.cache)
        return out[0]

    @torch.inference_mode()
    def _commit(self, features: torch.Tensor, tokens: list[int]) -> None:
        """Pairs (feature(t), token(t+1)) of newly committed positions; sets the root's predicted feature."""
        past, n = self._committed, len(tokens)
        allowed = torch.ones(n, past + n, dtype=torch.bool).tril(past)  # causal over the new entries
        out = self._run_head(features, tokens, torch.arange(past, past + n), allowed)
        self._root_feature = out[-1]

    def start(self, prompt_ids: list[int], prompt_hidden: torch.Tensor | None, *_) -> None:
        self.cache = DynamicCache()
        self._root_feature = None
        if prompt_hidden is not None and len(prompt_hidden):
            self._commit(prompt_hidden, prompt_ids[1:])

    def observe(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, next_token: int) -> None:
        rows = [0, *(i + 1 for i in path)]  # the root and the accepted nodes: their true features
        self._commit(hidden[rows], [*(tree.tokens[i] for i in path), next_token])

    @torch.inference_mode()
    def propose(self, context: list[int]) -> DraftTree:
        if self._root_feature is None:
            return DraftTree()
        past = self._committed
        # Drafted nodes: token, parent, cumulative log-prob, and (once expanded) its head-cache slot.
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        slot: dict[int, int] = {}  # node -> index of its entry among the drafted head-cache entries
        feature: dict[int, torch.Tensor] = {}  # node -> predicted feature after it (once expanded)

        def add_children(parent: int, logits: torch.Tensor, base: float) -> list[int]:
            top = logits.float().log_softmax(-1).topk(self.top_k)
            new = []
            for logp, tok in zip(top.values.tolist(), self.readout.to_target(top.indices).tolist(), strict=True):
                new.append(len(tokens))
                tokens.append(tok)
                parents.append(parent)
                scores.append(base + logp)
            return new

        frontier = add_children(-1, self.readout(self._root_feature), 0.0)
        for depth in range(2, self.depth + 1):
            expand = sorted(frontier, key=lambda i: -scores[i])[: self.top_k]
            n_drafted = len(slot)
            allowed = torch.zeros(len(expand), past + n_drafted + len(expand), dtype=torch.bool)
            allowed[:, :past] = True
            for row, node in enumerate(expand):
                slot[node] = n_drafted + row
                ancestor = node
                while ancestor >= 0:  # the node itself and its ancestors, all expanded before
                    allowed[row, past + slot[ancestor]] = True
                    ancestor = parents[ancestor]
            inputs = torch.stack([feature[parents[n]] if parents[n] >= 0 else self._root_feature for n in expand])
            positions = torch.full((len(expand),), past + depth - 2)
            out = self._run_head(inputs, [tokens[n] for n in expand], positions, allowed)  # (m, H)
            logits = self.readout(out)  # (m, N): N = V unless the head has a reduced draft vocabulary
            frontier = []
            for row, node in enumerate(expand):
                feature[node] = out[row]
                frontier += add_children(node, logits[row], scores[node])
        if slot:
            self.cache.crop(-len(slot))  # drafted entries never stay in the head's cache
        return rerank(tokens, parents, scores, self.budget)
