"""Each drafter's options as a dataclass: the one place their library defaults are written.

Defaults here are neutral (not tuned on any machine); `headstart.runtime.profiles` holds values
tuned for a model on a machine, applied on top of these. Nothing here imports torch, so the CLI can
read the options without loading a model.
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD_DTYPES = ("auto", "target", "float32", "bfloat16")  # an EAGLE head's dtype (`runtime.kernels.head_dtypes`)


def _at_least_one(**values: int) -> None:
    bad = {k: v for k, v in values.items() if v is None or v < 1}
    if bad:
        raise ValueError("must be >= 1: " + ", ".join(f"{k}={v}" for k, v in bad.items()))


@dataclass(frozen=True)
class NoOptions:
    """Plain decoding takes no option."""


@dataclass(frozen=True)
class LookupOptions:
    max_ngram: int = 3  # longest suffix n-gram searched
    min_ngram: int = 2  # shortest tried when longer ones find nothing (1-grams match noise)
    branch_len: int = 8  # tokens copied after a match
    max_branches: int = 2  # distinct continuations kept, most recent match first
    budget: int = 16  # most nodes in the tree

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        _at_least_one(branch_len=self.branch_len, max_branches=self.max_branches, budget=self.budget)


@dataclass(frozen=True)
class SuffixOptions(LookupOptions):
    """Prompt lookup, then the continuations of finished requests (`runtime/drafters/suffix.py`)."""

    max_match: int = 32  # a match is extended backwards up to this many tokens (longer ones rank first)
    min_match: int = 3  # the pool's branches are drafted when its longest match has at least this many tokens
    max_matches: int = 16  # the longest matches counted (the most recent among equals)
    scan: int = 64  # the most recent occurrences of the last 3 tokens looked at
    pool_tokens: int = 262_144  # the pool's size (the oldest requests leave first; docs/serving.md: measured); 0: none
    max_spec: int = 32  # the most tokens a pool branch drafts after its match ...
    spec_factor: float = 1.0  # ... a match of m tokens drafts up to max(branch_len, spec_factor * m) of them
    pool_nodes: int = 32  # the most nodes the pool's continuations give
    min_prob: float = 0.3  # a pool node is drafted when its estimated probability is at least this
    alone_gain: float = 2.0  # grafted: the pool's nodes alone, the heads resting, when they expect this many accepted

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least_one(
            max_match=self.max_match,
            max_matches=self.max_matches,
            scan=self.scan,
            max_spec=self.max_spec,
            pool_nodes=self.pool_nodes,
        )
        if not 0 <= self.min_prob <= 1 or not self.spec_factor >= 0 or not self.alone_gain > 0:
            raise ValueError(
                "need 0 <= min_prob <= 1, spec_factor >= 0, alone_gain > 0, got "
                f"{self.min_prob}, {self.spec_factor}, {self.alone_gain}"
            )
        if self.min_match > self.max_match:
            raise ValueError(f"need min_match <= max_match, got {self.min_match}, {self.max_match}")
        if self.pool_tokens < 0:
            raise ValueError(f"pool_tokens must be >= 0 (0: no pool), got {self.pool_tokens}")


@dataclass(frozen=True)
class GraftOptions:
    """`NAME+lookup`: prompt-lookup branches grafted onto NAME's tree."""

    graft_budget: int = 8  # the most nodes the lookup branches add to the inner tree

    def __post_init__(self) -> None:
        _at_least_one(graft_budget=self.graft_budget)


@dataclass(frozen=True)
class HeadsOptions:
    heads: str | None = None  # trained heads directory; None: the heads shipped for the model, if any
    draft_vocab: int | None = None  # read out only the N most frequent draft tokens; None: all of them
    allow_adapter_mismatch: bool = False  # run heads trained for another LoRA adapter (exact, acceptance may drop)
    draft_temperature: float = 1.0  # T > 0: guesses drawn from the heads' q at the decode's temperature times this

    def __post_init__(self) -> None:
        if self.draft_vocab is not None:
            _at_least_one(draft_vocab=self.draft_vocab)
        if not 0 < self.draft_temperature < float("inf"):
            raise ValueError(f"draft_temperature must be a finite number > 0, got {self.draft_temperature}")


@dataclass(frozen=True)
class MedusaOptions(HeadsOptions):
    budget: int = 16  # nodes of the static tree, shaped from the heads' measured per-rank accuracies

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least_one(budget=self.budget)


@dataclass(frozen=True)
class EagleOptions(HeadsOptions):
    depth: int = 5  # drafting depth
    top_k: int = 4  # nodes expanded per depth, and children per expanded node
    budget: int = 16  # nodes kept of the dynamic tree (T = 0, or heads without per-rank accuracies)
    min_prob: float = 0.0  # stop growing once the likeliest frontier path is less likely than this (sampled: per node)
    sampled_budget: int = 16  # nodes of the static tree sampled at T > 0
    head_dtype: str = "auto"  # the head's: one of HEAD_DTYPES (auto: `runtime.kernels.head_dtypes`)

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least_one(depth=self.depth, top_k=self.top_k, budget=self.budget, sampled_budget=self.sampled_budget)
        if self.head_dtype not in HEAD_DTYPES:
            raise ValueError(f"head_dtype must be one of {', '.join(HEAD_DTYPES)}, got {self.head_dtype!r}")
        if not 0 <= self.min_prob < 1:
            raise ValueError(f"min_prob must be in [0, 1), got {self.min_prob}")


@dataclass(frozen=True)
class TreeOptions:
    """A draft model's chain (top_k = 1) of `depth` tokens, or its dynamic tree of `budget` nodes."""

    depth: int = 4
    top_k: int = 1
    budget: int = 16

    def __post_init__(self) -> None:
        _at_least_one(depth=self.depth, top_k=self.top_k, budget=self.budget)


@dataclass(frozen=True)
class ModelOptions(TreeOptions):
    draft_model: str | None = None  # a small causal LM with the target's tokenizer (path or embedded name)


@dataclass(frozen=True)
class LayerskipOptions(TreeOptions):
    draft_layers: str | int | None = None  # the target's first N layers, or a comma list such as "0,1,2,5"

    def layers(self) -> list[int]:
        """The layer indices `draft_layers` names."""
        if self.draft_layers is None:
            raise ValueError("the layerskip drafter needs `draft_layers` (N, or a list such as 0,1,2,5)")
        text = str(self.draft_layers).strip()
        try:
            return list(range(int(text))) if text.isdigit() else [int(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"draft_layers takes N or a comma list of layer indices, got {text!r}") from None
