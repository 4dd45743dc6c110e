"""EAGLE drafter: the EAGLE head runs autoregressively on features and drafts a dynamic tree (EAGLE-2).

The head's own KV cache holds one entry per committed pair (feature(t), token(t+1)) at position t,
built from the target's true features; its output at the last pair is the predicted feature at
the root, whose lm_head readout scores the root's children. The prompt's pairs and the pairs a round commits wait
until the next `propose` (`observe` only queues them): a request that never drafts (a busy batch) never runs the
head over its prompt, rounds that draft nothing (a plain round under load) cost no head forward, and their pairs
enter the cache in one forward when drafting resumes (the load budget charges that backlog, less the prompt's
pairs, to the request's trees). Drafting, depth by depth: score every
frontier node by the cumulative log-probability of its path, expand the `top_k` best (one head
forward over all of them, a tree mask inside the head), give each its `top_k` likeliest children.
Then rerank every drafted node by cumulative log-probability and keep the best `budget`: a child is
never likelier than its parent, so the kept set is a tree. Growth stops early once the likeliest
frontier path is less likely than `min_prob` (a head forward saved). Drafted entries leave the
head's cache after each round; the features of the accepted path, from the target's verification
pass, enter it.
Every node is a deterministic guess (a point mass). Heads trained with a reduced draft vocabulary
score only its tokens (`heads.vocab`); log-probabilities are then normalised over those.

At temperature > 0, given the head's measured per-rank accuracies (a static shape of `sampled_budget`
nodes, `choose_tree_shape`), the tree is SAMPLED instead (`runtime.tree.ShapeSampler`): the same
depth-by-depth head forwards, but each expanded node's children are drawn from the head's q
without replacement and carry q, so verification accepts with min(1, p/q) rather than p(x) of a
point mass. A dynamic tree cannot be sampled this way: keeping the likeliest drawn nodes would bias
which tokens are proposed. A sampled node gets children only when its path is at least `min_prob` likely
under q (a function of the path alone: exact).

With a `sizer` (`runtime.sizing.cost_curve.LiveSizer`, set by `Engine.make_drafter` for calibrated heads) the
drafter reports after every round how many of its own nodes were accepted (grafted lookup nodes not
counted) and takes the budget, depth or sampled shape the sizer chooses from them (`resize`).

The head may run in another dtype than the target (`head_dtype`; by default greedy decodes draft in bfloat16 under
a float32 target on a CPU with bf16 kernels: `runtime.kernels.head_dtypes`); features and embeddings enter in it.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from transformers import DynamicCache

from headstart.heads.eagle import EagleHead
from headstart.heads.eagle3 import Eagle3Head
from headstart.heads.masks import causal_after
from headstart.heads.vocab import DraftReadout
from headstart.runtime.attention import attend_with_grouped_sdpa
from headstart.runtime.drafters.base import Offer, SamplingDrafter
from headstart.runtime.drafters.native_head import HeadCache, NativeHead
from headstart.runtime.drafters.options import EagleOptions
from headstart.runtime.drafters.together import Drafting, HeadStep, drive
from headstart.runtime.kernels import head_dtypes, prepack_like_target
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.tree import DraftTree, ShapeSampler, TreeChoice, TreeGrower, choose_tree_shape, scale_accuracy

OFFERED = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)  # the tree sizes `offers` offers (the budget's choice)


class EagleDrafter(SamplingDrafter):
    name = "eagle"

    def __init__(
        self,
        head: EagleHead | Eagle3Head,
        embed: nn.Module,
        lm_head: nn.Module,
        options: EagleOptions | None = None,
        rank_accuracy: list[list[float]] | None = None,
        name: str = "eagle",
    ) -> None:
        """`name`: the head's kind (eagle, eagle3). `rank_accuracy` (the head's measured per-depth, per-rank
        accuracies) gives the static tree of `options.sampled_budget` nodes sampled at temperature > 0; without
        it the top-k dynamic tree is used at every temperature. `options.draft_vocab` reads out only that many of
        the head's most frequent draft tokens. The dynamic tree grows no deeper once its likeliest frontier path
        is less likely than `options.min_prob`. `options.draft_temperature`: the sampled tree's draft
        temperature, as a factor on the decode's (`SamplingDrafter`)."""
        o = options or EagleOptions()
        super().__init__(lm_head.weight.device, o.draft_temperature)
        self.embed = embed
        greedy, sampled = head_dtypes(o.head_dtype, lm_head.weight)
        built: dict[torch.dtype, tuple[torch.dtype, nn.Module | NativeHead, DraftReadout]] = {}
        for dtype in {greedy, sampled}:
            own = head if next(head.parameters()).dtype == dtype else copy.deepcopy(head).to(dtype)  # theirs as is
            readout = own.readout(lm_head, o.draft_vocab).to(dtype)
            prepack_like_target(lm_head, own, readout)  # packed kernels when the target's are
            attend_with_grouped_sdpa(own)  # it reads packed rows when sequences draft together (`together.py`)
            built[dtype] = (dtype, NativeHead.build(own) or own, readout)  # the native draft layers where they run
        self._heads = {True: built[greedy], False: built[sampled]}  # (dtype, head, readout) by greedy or not
        self._draft_in(greedy=True)
        self.feature_layers = head.feature_layers
        self.name = name
        self.vocab_size = lm_head.weight.shape[0]
        self.depth, self.top_k, self.budget, self.min_prob = o.depth, o.top_k, o.budget, o.min_prob
        self.shape = choose_tree_shape(rank_accuracy, o.sampled_budget) if rank_accuracy else None
        self.cache = self._new_cache()
        self._root_feature: torch.Tensor | None = None  # (H,) predicted feature at the root's position
        self._pending: list[tuple[torch.Tensor, list[int]]] = []  # committed pairs not yet in the cache
        self._backlog = 0  # of them, the rounds' (the prompt's are not counted: `backlog`)
        self.sizer = None  # a runtime.sizing.cost_curve.LiveSizer (drafters never import sizing)
        self._drafted = 0  # nodes of the last tree proposed; a graft's nodes come after them
        self._sized: tuple[tuple[int, ...], ...] | None = None  # the static shape a size gave (None: the sizer's)

    def clear(self) -> None:
        super().clear()
        self.cache = self._new_cache()
        self._root_feature = None
        self._pending, self._backlog = [], 0
        self._drafted = 0
        self._sized = None

    def resize(self, choice: TreeChoice, sampled: bool) -> None:
        """Take the budget and depth (greedy) or the static shape (sampled) of `choice`; `depth` bounds both."""
        if sampled:
            self.shape = list(choice.shape)
        else:
            self.budget, self.depth = choice.budget, choice.depth

    def curve(self, max_nodes: int, factor: float = 1.0) -> list[Offer]:
        """The trees of 1..`max_nodes` nodes this drafter can draft now, each the best of its size
        (`runtime/sizing/planner.py`): node k of the best static tree (`choose_tree_shape`) under the sizer's
        accuracies, as live traffic corrected them and times `factor` (a request's own correction), survives with the
        product of its path's accuracies; drafting costs the sizer's measured ms per depth (its measured shared part
        paid once by the sequences drafting together). Each offer carries its tree (`shape`), which `drafting`
        drafts when it is handed back. [] without a sizer (heads with no calibrated accuracies)."""
        s = self.sizer
        if s is None:
            return []
        key = ("curve", s.factor[self._samples] * factor, self._samples, max_nodes)
        offers = s.curves.get(key)
        if offers is None:
            shape, gains = self._tree(key[1], max_nodes)
            offers, depth = [], 0
            for n, path in enumerate(shape, start=1):
                depth = max(depth, len(path))
                if n in OFFERED or n == len(shape):
                    ms = s.draft_ms * depth
                    offers.append(Offer(n, gains[n], ms, heads=n, shared_ms=s.shared * ms, shape=tuple(shape[:n])))
            s.curves[key] = offers
        return offers

    def _tree(self, factor: float, max_nodes: int) -> tuple[list[tuple[int, ...]], list[float]]:
        """The best static tree of at most `max_nodes` nodes with the sizer's rank accuracies times `factor`, and
        the expected accepted nodes of its first n nodes, n = 0, 1, ..."""
        s = self.sizer
        assert s is not None
        if len(s.curves) >= 1024:  # the traffic's factor moved on: the old curves are not asked for again
            s.curves.clear()
        accuracy = scale_accuracy(s.rank_accuracy, factor)
        shape = choose_tree_shape(accuracy, max_nodes)
        gains = [0.0]
        for path in shape:
            gains.append(gains[-1] + math.prod(accuracy[d][rank] for d, rank in enumerate(path)))
        return shape, gains

    def _size(self, size: Offer) -> None:
        """Draft `size.nodes` nodes (0: none; the queued pairs wait): the tree of the offer, its budget and depth
        (greedy), its static shape (sampled)."""
        self.budget = size.nodes
        shape = list(size.shape or ())[: size.nodes]
        self._sized = tuple(shape) if size.shape is not None else None
        if shape:
            self.depth = max(len(path) for path in shape)
            if self._samples:
                self.shape = shape

    @property
    def catch_up_ms(self) -> float:
        """Its backlog's pairs at the sizer's measured ms a pair (0 without a sizer)."""
        return self._backlog * self.sizer.pair_ms if self.sizer is not None else 0.0

    @property
    def backlog(self) -> int:
        """Pairs of its plain rounds waiting to enter the head's cache before it drafts again: what the load budget
        charges its trees. The prompt's pairs wait too but are not charged: a request pays them once if it ever
        drafts; charged to its first tree, a request alone started plain, its backlog grew each plain round and it
        drafted in a third of its rounds; entered at `start` instead, every request paid them, drafting or not
        (bfloat16, 16 sequences in-process: 2.4 % of the run, where 3 rounds of 202 speculated)."""
        return self._backlog

    @property
    def _samples(self) -> bool:
        """Whether this round's tree is sampled (a static shape at T > 0) rather than the greedy dynamic one."""
        return self.shape is not None and not self.sampling.greedy

    @property
    def _committed(self) -> int:
        return self.cache.get_seq_length()

    def _step(
        self, features: torch.Tensor, tokens: list[int], positions: torch.Tensor, allowed: torch.Tensor, read: int
    ):
        """A head forward appending len(tokens) entries to the head's cache (`together.HeadStep`): `features` (n, F),
        `allowed` (n, past + n); the last `read` outputs read out."""
        return HeadStep(self.head, self.readout, self.embed, self.cache, features, tokens, positions, allowed, read)

    def _enter(self, features: torch.Tensor, tokens: list[int], read: int) -> HeadStep:
        """The head forward entering committed pairs (features (n, F), their next tokens) into its cache, causal
        over the new entries after the committed ones."""
        past, n = self._committed, len(tokens)
        allowed = causal_after(past, n)
        return self._step(features, tokens, torch.arange(past, past + n), allowed, read)

    def _new_cache(self) -> HeadCache | DynamicCache:
        """An empty cache for the head this drafter drafts with now: a slot of the native draft layers' pool, or a
        DynamicCache for transformers' layers."""
        return self.head.new_cache() if isinstance(self.head, NativeHead) else DynamicCache()

    def _draft_in(self, greedy: bool) -> None:
        """Draft with the head of a greedy or of a sampled decode; features and embeddings enter in its dtype."""
        self.dtype, self.head, self.readout = self._heads[greedy]

    def start(self, prompt_ids, prompt_hidden, sampling: SamplingParams | None = None, seed: int | None = None):
        self._root_feature = None
        self.start_sampling(sampling, seed)
        self._draft_in(self.sampling.greedy)
        self.cache = self._new_cache()
        has = prompt_hidden is not None and len(prompt_hidden)
        self._pending = [(prompt_hidden.to(self.dtype), list(prompt_ids[1:]))] if has else []  # at the first drafting
        self._backlog = 0

    def observe(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, next_token: int) -> None:
        rows = [0, *(i + 1 for i in path)] if path else slice(1)  # the root and the accepted nodes: their features
        self._pending.append((hidden[rows].to(self.dtype), [*(tree.tokens[i] for i in path), next_token]))
        self._backlog += 1 + len(path)
        if self.sizer is not None and self._drafted and len(tree):
            ours = next((k for k, node in enumerate(path) if node >= self._drafted), len(path))
            choice = self.sizer.record(self._samples, ours, self._sized)
            if choice is not None:
                self.resize(choice, self._samples)

    def rest(self) -> None:
        self._drafted = 0  # the pairs wait, as after a plain round; the sizer records nothing of this round

    @torch.inference_mode()
    def propose(self, context: list[int]) -> DraftTree:
        return drive(self.drafting(context))

    def drafting(self, context: list[int], size: Offer | None = None) -> Drafting:
        self._drafted = 0
        if size is not None:
            self._size(size)
        if not self.budget:
            return DraftTree()
        if self._pending:  # the pairs of the rounds since the last proposal, in one head forward
            features = torch.cat([f for f, _ in self._pending])
            tokens = [t for _, queued in self._pending for t in queued]
            self._pending, self._backlog = [], 0
            out, root_logits = yield self._enter(features, tokens, read=1)
            self._root_feature = out[-1]  # (H,) the predicted feature at the root
        elif self._root_feature is not None:
            root_logits = self.readout(self._root_feature[None])
        if self._root_feature is None:
            return DraftTree()
        past = self._committed
        feature: dict[int, torch.Tensor] = {}  # node -> predicted feature after it (once expanded)
        if self._samples:
            grow = ShapeSampler(self.shape, self.draft_sampling, self.vocab_size, self.generator, self.min_prob)
        else:
            grow = TreeGrower(self.top_k, self.budget, self.min_prob)
        frontier = grow.add_children([-1], root_logits, self.readout.to_target)
        for depth in range(1, self.depth):  # expand nodes at `depth`: their children are at depth + 1
            expand, allowed = grow.expand(frontier, past)  # allowed: (m, past + drafted)
            if not expand:
                break
            parents = [grow.parents[n] for n in expand]
            inputs = torch.stack([feature[p] if p >= 0 else self._root_feature for p in parents])  # (m, H)
            positions = torch.full((len(expand),), past + depth - 1)
            step = self._step(inputs, [grow.tokens[n] for n in expand], positions, allowed, read=len(expand))
            out, logits = yield step  # (m, H), (m, N): N = V unless the head has a reduced draft vocabulary
            feature.update(zip(expand, out, strict=True))
            frontier = grow.add_children(expand, logits, self.readout.to_target)
        if grow.n_drafted:
            self.cache.crop(-grow.n_drafted)  # drafted entries never stay in the head's cache
        tree = grow.tree()
        self._drafted = len(tree)
        return tree
