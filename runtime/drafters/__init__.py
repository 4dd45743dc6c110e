"""Drafters: everything that proposes a DraftTree for the one verifier.

A drafter sees the sequence (prompt + accepted tokens, the root last) and returns a tree of guesses
for what follows the root. It is told what the target accepted after every round, so drafters that
keep state (EAGLE features, a draft model's cache) can stay in sync; stateless ones ignore it.
"""

from __future__ import annotations

import torch

from runtime.sampling import SamplingParams
from runtime.tree import DraftTree

# Draft tokens the trained heads read out by default: the first 12,288 of their frequency-ordered
# draft vocabulary. A bf16 readout of 16,384 x 576 falls out of this 2-core CPU's 32 MB L3; 12,288
# drafted as well on held-out prompts, 15.2 instead of 17.4 ms a round (README: Drafter defaults).
DRAFT_VOCAB = 12288

# Nodes of the Medusa tree by default (its shape: `choose_tree_shape` over the heads' saved per-rank
# accuracies). Its heads guess deep tokens poorly, so a small tree pays best on this 2-core CPU:
# 7 nodes ran 1.27x / 1.37x on the held-out prompts, 16 nodes 1.20x / 1.26x (README: Drafters).
MEDUSA_BUDGET = 7

DRAFTERS = ("none", "lookup", "medusa", "eagle", "model", "layerskip")
GRAFTED = tuple(f"{name}+lookup" for name in ("medusa", "eagle", "model", "layerskip"))  # runtime.drafters.graft


def base_drafter(name: str) -> str:
    """The drafter a grafted name builds on (`eagle+lookup` -> `eagle`); any other name as it is."""
    return name.removesuffix("+lookup") if name in GRAFTED else name


class Drafter:
    """Base class: proposes nothing (plain decoding)."""

    name = "none"

    def start(
        self,
        prompt_ids: list[int],
        prompt_hidden: torch.Tensor | None,
        sampling: SamplingParams | None = None,
        seed: int | None = None,
    ) -> None:
        """A new sequence begins; `prompt_hidden` (len-1, H) are the target's features of all but the root.

        `sampling` and `seed` are the decode's: drafters that sample their guesses use them.
        """

    def propose(self, context: list[int]) -> DraftTree:
        """A tree of guesses for the tokens after `context[-1]`."""
        return DraftTree()

    def observe(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, next_token: int) -> None:
        """The target accepted `path` of `tree` (its features `hidden`, (n+1, H)) and chose `next_token`."""


class SamplingDrafter(Drafter):
    """Base of the drafters that sample their guesses at T > 0: the decode's sampling parameters and a
    random stream of their own."""

    def __init__(self, device: torch.device | str) -> None:
        self.sampling = SamplingParams()
        self.generator = torch.Generator(device=device)

    def start_sampling(self, sampling: SamplingParams | None, seed: int | None) -> None:
        """Take the decode's `sampling`; seed the stream from its `seed` (+1: not the verifier's stream)."""
        self.sampling = sampling or SamplingParams()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed + 1)


def make_drafter(
    name: str,
    model=None,
    tokenizer=None,
    heads: str | None = None,
    tree_budget: int | None = None,
    tree_depth: int | None = None,
    tree_top_k: int | None = None,
    model_name: str | None = None,
    draft_model: str | None = None,
    draft_layers: str | int | None = None,
    draft_vocab: int | None = None,
    **options: int,
) -> Drafter:
    """Build a drafter by its CLI name; trained drafters load `heads` (a checkpoint directory) onto `model`.

    Without `heads`, the heads shipped for `model_name` (an embedded model's name) are used if there are any.
    `model` drafts with the causal LM `draft_model` (a path or embedded name); `layerskip` with the
    target's first `draft_layers` layers (an int, or a comma list of layer indices starting at 0).
    `NAME+lookup` grafts prompt-lookup branches onto NAME's greedy trees (`graft.LookupGraft`).
    `medusa` and `eagle` read out only the `draft_vocab` most frequent tokens of their heads' draft
    vocabulary (None: DRAFT_VOCAB; heads with the full vocabulary read all of it).
    """
    if name == "none":
        return Drafter()
    if name in ("lookup", *GRAFTED):
        from runtime.drafters.lookup import LookupDrafter

        lookup = LookupDrafter(**options)
        if name == "lookup":
            return lookup
        from runtime.drafters.graft import LookupGraft

        knobs = dict(tree_budget=tree_budget, tree_depth=tree_depth, tree_top_k=tree_top_k, model_name=model_name,
                     draft_model=draft_model, draft_layers=draft_layers, draft_vocab=draft_vocab)  # fmt: skip
        return LookupGraft(make_drafter(base_drafter(name), model, tokenizer, heads, **knobs), lookup)
    tree = {k: v for k, v in {"depth": tree_depth, "top_k": tree_top_k, "budget": tree_budget}.items() if v is not None}
    if name in ("model", "layerskip"):
        return _make_model_drafter(name, model, tokenizer, model_name, draft_model, draft_layers, tree)
    if name not in ("medusa", "eagle"):
        raise ValueError(f"unknown drafter '{name}': choose from {', '.join(DRAFTERS + GRAFTED)}")
    from heads.checkpoint import load_heads, shipped_heads

    if heads is None and model_name is not None:
        heads = shipped_heads(model_name, name)
    if heads is None or model is None:
        shipped = f": none are shipped for {model_name}" if model_name else ""
        raise ValueError(f"the {name} drafter needs trained heads (--heads DIR){shipped}")
    module, config = load_heads(heads, model, tokenizer)
    if config["kind"] != name:
        raise ValueError(f"{heads} holds {config['kind']} heads, not {name} heads")
    draft_vocab = DRAFT_VOCAB if draft_vocab is None else draft_vocab
    if name == "eagle":
        from runtime.drafters.eagle import EagleDrafter

        embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        if tree_budget is not None:  # --tree-budget sets the tree at every temperature
            tree["sampled_budget"] = tree_budget
        return EagleDrafter(
            module, embed, lm_head, rank_accuracy=config.get("rank_accuracy"), draft_vocab=draft_vocab, **tree
        )
    from runtime.drafters.medusa import MedusaDrafter
    from runtime.tree import choose_tree_shape

    budget = MEDUSA_BUDGET if tree_budget is None else tree_budget
    if budget < 1:
        raise ValueError(f"tree budget must be >= 1, got {budget}")
    shape = choose_tree_shape(config["rank_accuracy"], budget)
    return MedusaDrafter(module, model.get_output_embeddings(), shape, draft_vocab)


def _make_model_drafter(name, model, tokenizer, model_name, draft_model, draft_layers, tree: dict) -> Drafter:
    from runtime.drafters.model import ModelDrafter, check_same_tokenizer

    if model is None:
        raise ValueError(f"the {name} drafter needs the target model")
    if name == "layerskip":
        if draft_layers is None:
            raise ValueError("the layerskip drafter needs --draft-layers N (or a list such as 0,1,2,5)")
        if isinstance(draft_layers, int) or str(draft_layers).strip().isdigit():
            layers = list(range(int(draft_layers)))
        else:
            try:
                layers = [int(x) for x in str(draft_layers).split(",")]
            except ValueError:
                raise ValueError(
                    f"--draft-layers takes N or a comma list of layer indices, got {draft_layers!r}"
                ) from None
        return ModelDrafter.layerskip(model, layers, **tree)
    if draft_model is None:
        raise ValueError("the model drafter needs --draft-model PATH_OR_NAME")
    from runtime.models import load_model

    draft, draft_tokenizer = load_model(draft_model, dtype=model.dtype, device=str(model.device))
    check_same_tokenizer(tokenizer, draft_tokenizer, model_name or "the target", draft_model)
    return ModelDrafter(draft, vocab_size=model.config.vocab_size, **tree)
