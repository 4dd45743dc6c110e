"""Medusa drafter: K heads read the target's last verified feature; a static tree of their top-k guesses.

The feature is the target's final hidden state at the position just before the root (the last
accepted token); there head k predicts the token k places below the root. The tree's shape, a list
of rank paths such as (0,), (1,), (0, 0), is chosen from the heads' measured per-rank accuracies
(`runtime.tree.choose_tree_shape`). At temperature 0 every node is a deterministic top-k guess: a
point mass. At temperature > 0 the same shape is SAMPLED (`runtime.tree.ShapeSampler`): each
node's children are drawn without replacement from head d's q (the decode's temperature / top-k /
top-p on its logits) and carry q, so verification accepts with min(1, p/q). Head d's q does not
depend on the tokens above it, so every node at one depth draws from the same q.
Heads trained with a reduced draft vocabulary score only its tokens (`heads.vocab`).
"""

from __future__ import annotations

import torch
from torch import nn

from headstart.heads.medusa import MedusaHeads
from headstart.runtime.drafters.base import SamplingDrafter
from headstart.runtime.kernels import prepack_like_target
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.tree import DraftTree, ShapeSampler, choose_tree_shape


class MedusaDrafter(SamplingDrafter):
    feature_layers = (-1,)  # the target's last hidden state, after the final norm
    name = "medusa"

    def __init__(
        self,
        heads: MedusaHeads,
        lm_head: nn.Module,
        shape: list[tuple[int, ...]],
        draft_vocab: int | None = None,
        draft_temperature: float = 1.0,
        name: str = "medusa",
    ) -> None:
        """`shape`: the tree's paths of ranks, parents first; `draft_vocab` reads out only that many of the
        heads' most frequent draft tokens; `draft_temperature`: the sampled tree's, as a factor on the decode's
        (`SamplingDrafter`); `name`: the heads' kind (medusa, medusa2)."""
        self.name = name
        if not shape:
            raise ValueError("empty Medusa tree shape")
        depth = max(map(len, shape))
        if depth > heads.num_heads:
            raise ValueError(f"tree shape is {depth} deep but there are only {heads.num_heads} heads")
        index = {path: i for i, path in enumerate(shape)}
        bad = [p for i, p in enumerate(shape) if len(p) > 1 and index.get(p[:-1], len(shape)) > i]
        if bad:
            raise ValueError(f"tree shape must list every parent before its children (bad: {bad[:3]})")
        super().__init__(lm_head.weight.device, draft_temperature)
        self.heads, self.readout, self.shape = heads, heads.readout(lm_head, draft_vocab), shape
        prepack_like_target(lm_head, heads, self.readout)  # packed kernels when the target's are
        self.depth = depth
        self.ranks = max(p[-1] for p in shape) + 1
        self.parents = [index[p[:-1]] if len(p) > 1 else -1 for p in shape]
        self._feature: torch.Tensor | None = None  # (H,) target feature just before the root
        self.vocab_size = lm_head.weight.shape[0]

    def clear(self) -> None:
        super().clear()
        self._feature = None

    @classmethod
    def from_accuracies(cls, heads: MedusaHeads, lm_head: nn.Module, rank_accuracy, budget: int) -> MedusaDrafter:
        return cls(heads, lm_head, choose_tree_shape(rank_accuracy, budget))

    def start(self, prompt_ids, prompt_hidden, sampling: SamplingParams | None = None, seed: int | None = None):
        self._feature = prompt_hidden[-1] if prompt_hidden is not None and len(prompt_hidden) else None
        self.start_sampling(sampling, seed)

    @torch.inference_mode()
    def propose(self, context: list[int]) -> DraftTree:
        if self._feature is None:
            return DraftTree()
        feats = self.heads.features(self._feature[None])[: self.depth, 0]  # (D, H)
        logits = torch.stack([self.heads.head_logits(k + 1, feats[k], self.readout) for k in range(self.depth)])
        if not self.sampling.greedy:  # (D, N): N = V unless the heads have a reduced draft vocabulary
            return self._sample_tree(logits)
        top = self.readout.to_target(logits.topk(self.ranks, dim=-1).indices).tolist()  # (D, R) target ids
        return DraftTree([top[len(p) - 1][p[-1]] for p in self.shape], list(self.parents))

    def _sample_tree(self, logits: torch.Tensor) -> DraftTree:
        """The shape filled depth by depth with draws from each head's q, (D, N) logits."""
        grow = ShapeSampler(self.shape, self.draft_sampling, self.vocab_size, self.generator)
        frontier = grow.add_children([-1], logits[:1], self.readout.to_target)
        for depth in range(1, self.depth):
            parents = grow.choose(frontier)
            if not parents:
                break
            frontier = grow.add_children(parents, logits[depth].expand(len(parents), -1), self.readout.to_target)
        return grow.tree()

    def observe(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, next_token: int) -> None:
        self._feature = hidden[path[-1] + 1] if path else hidden[0]
