"""The drafter interface: everything that proposes a DraftTree for the one verifier.

A drafter sees the sequence (prompt + accepted tokens, the root last) and returns a tree of guesses
for what follows the root. It is told what the target accepted after every round, so drafters that
keep state (EAGLE features, a draft model's cache) can stay in sync; stateless ones ignore it.
A drafter serves one sequence at a time: build one per concurrent decode (`registry.make_drafter`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import torch

from headstart.runtime.sampling import MIN_TEMPERATURE, SamplingParams
from headstart.runtime.tree import DraftTree

if TYPE_CHECKING:
    from headstart.runtime.drafters.together import Drafting


class Offer(NamedTuple):
    """A tree a sequence's drafter can draft this round, what it is worth and costs (a tuple: a batch's drafters make
    hundreds a round); runtime/sizing decides which is drafted and hands it back as the round's size
    (`Drafter.drafting`)."""

    nodes: int  # rows it adds beyond the root (an upper bound: the tree is cut to the width it is given)
    gain: float  # expected draft nodes accepted (tokens beyond the target's own one)
    draft_ms: float  # what drafting it alone costs
    heads: int = 0  # nodes the drafter's own model drafts (the rest: grafted lookup branches)
    graft: bool = False  # lookup branches grafted on
    pool: bool = False  # the suffix pool's tree alone, the drafter's own model resting (`graft.LookupGraft`)
    shared_ms: float = 0.0  # of draft_ms, what sequences drafting together pay once (their head forwards' weights)
    shape: tuple[tuple[int, ...], ...] | None = None  # the heads' static tree it was valued as (`Drafter.curve`)


PLAIN = Offer(0, 0.0, 0.0)  # the size of a plain step: nothing drafted


class Drafter:
    """Base class: proposes nothing (plain decoding)."""

    name = "none"
    feature_layers: tuple[int, ...] = ()  # the target hidden states `start`/`observe` receive, concatenated; () none

    def start(
        self,
        prompt_ids: list[int],
        prompt_hidden: torch.Tensor | None,
        sampling: SamplingParams | None = None,
        seed: int | None = None,
    ) -> None:
        """A new sequence begins; `prompt_hidden` (len-1, F) are the target's features of all but the root (None
        when `feature_layers` names none).

        `sampling` and `seed` are the decode's: drafters that sample their guesses use them.
        """

    def propose(self, context: list[int]) -> DraftTree:
        """A tree of guesses for the tokens after `context[-1]`."""
        return DraftTree()

    def drafting(self, context: list[int], size: Offer | None = None) -> Drafting:
        """`propose` as a generator of the head forwards it needs (`runtime/drafters/together.py`: the forks of a
        drafter with a head draft together, one forward per step for the batch); a drafter without a head asks for
        none. `size`: the tree the round's plan gave it, one of the offers it made (`curve`, or its whole tree cut
        to `size.nodes`; PLAIN: nothing); None: its own tree."""
        if size is not None and not size.nodes:
            return DraftTree()
        tree = self.propose(context)
        return tree if size is None else tree.prefix(size.nodes)
        yield  # a generator, which yields nothing

    def curve(self, max_nodes: int, factor: float = 1.0) -> list[Offer]:
        """What each size of its tree is worth: the trees of up to `max_nodes` nodes it can draft now, each with its
        expected accepted nodes (its calibrated accuracies times `factor`, a request's own correction) and its
        drafting ms, each drafted by `drafting` when handed back. []: no calibrated accuracies (runtime/sizing
        then prices its whole tree by what its rounds accepted)."""
        return []

    @property
    def drafts(self) -> bool:
        """Whether it ever drafts a node: False for the none drafter (this class as it is), whose tree a graft's
        lookup branches may fill alone (`lookup`)."""
        return type(self).propose is not Drafter.propose or type(self).drafting is not Drafter.drafting

    @property
    def catch_up_ms(self) -> float:
        """What its next drafting costs before it drafts (a head entering the pairs of its plain rounds)."""
        return 0.0

    @property
    def graft(self) -> Drafter | None:
        """The lookup grafted onto its tree (a `graft.LookupGraft`: itself), None: none."""
        return None

    def rest(self) -> None:
        """Draft nothing this round: a graft verifies another source's tree instead (`graft.LookupGraft`), which
        `observe` then receives (its nodes are none of this drafter's)."""

    def observe(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, next_token: int) -> None:
        """The target accepted `path` of `tree` (its features `hidden`, (n+1, F), or None) and chose `next_token`."""

    def finish(self, context: list[int]) -> None:
        """The sequence left the batch (done, cancelled): `context` is its prompt and every token it was given.
        Drafters that learn from past requests keep it (`suffix.SuffixDrafter`)."""

    def fork(self) -> Drafter:
        """A drafter for another sequence, decoded beside this one: the same model, heads and options (shared, not
        copied: a fork costs no load and no packing), a state of its own, empty until `start`."""
        twin = copy.copy(self)
        twin.clear()
        return twin

    def clear(self) -> None:
        """Forget the sequence (a fork's state is its own from here on): what `fork` calls on the copy."""


class SamplingDrafter(Drafter):
    """Base of the drafters that sample their guesses at T > 0: the decode's sampling parameters and a
    random stream of their own.

    At T > 0 the guesses are drawn from the draft's q at the decode's temperature times `draft_temperature`
    (`draft_sampling`; top-k and top-p as the decode's). Below 1 it sharpens a q flatter than the target's p,
    which raises the chance min(1, p/q) that a draw is accepted. Exact at any value: each node records the q it
    was drawn from, and `accept_path` tests it against p at the decode's own settings."""

    def __init__(self, device: torch.device | str, draft_temperature: float = 1.0) -> None:
        self.sampling = self.draft_sampling = SamplingParams()
        self.draft_temperature = draft_temperature
        self.generator = torch.Generator(device=device)

    def clear(self) -> None:
        self.sampling = self.draft_sampling = SamplingParams()
        self.generator = torch.Generator(device=self.generator.device)

    def start_sampling(self, sampling: SamplingParams | None, seed: int | None) -> None:
        """Take the decode's `sampling`; seed the stream from its `seed` (+1: not the verifier's stream)."""
        self.sampling = sampling or SamplingParams()
        # a sampling decode keeps a sampled draft: the product must not fall below the greedy threshold
        scaled = max(self.sampling.temperature * self.draft_temperature, MIN_TEMPERATURE)
        self.draft_sampling = dataclasses.replace(self.sampling, temperature=0.0 if self.sampling.greedy else scaled)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed + 1)
