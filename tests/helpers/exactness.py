"""Shared checks of "speculative decoding == the target": greedy identity with HF generate, and a
chi-square test of the first three sampled tokens against their exact distribution."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from headstart.runtime.drafters.base import Drafter
from headstart.runtime.generate import GenerationStats, stream
from headstart.runtime.sampling import SamplingParams, target_probs
from headstart.runtime.target import Target
from helpers.models import tiny_llama
from helpers.stats import chi_square_pvalue

SAMPLING = SamplingParams(temperature=0.8, top_p=0.9)


def generate_ids(target: Target, prompt: list[int], drafter: Drafter | None = None, **kwargs) -> list[int]:
    return [t for chunk in stream(target, prompt, drafter, **kwargs) for t in chunk.tokens]


@dataclass
class Speculation:
    """What the greedy identity runs saw of speculation (the target's tokens are checked apart)."""

    rounds: int = 0  # target verification passes
    new_tokens: int = 0
    accepted: int = 0  # draft tokens the target accepted
    siblings: int = 0  # rounds that committed a node which is not its parent's first child (a rank > 0 branch)
    head_accepted: int = 0  # accepted nodes the inner drafter proposed (`NAME+lookup`: not the grafted ones)

    @property
    def acceptance_length(self) -> float:
        """Tokens per target pass."""
        return self.new_tokens / max(self.rounds, 1)


def assert_greedy_identity(model, drafter: Drafter, prompts: list[list[int]], max_new_tokens: int = 40) -> Speculation:
    """Our loop with `drafter` gives `model.generate(do_sample=False)`'s tokens; returns what speculation did."""
    target, seen = Target(model), Speculation()
    inner = getattr(drafter, "inner", drafter)  # `NAME+lookup` grafts onto NAME's tree, whose nodes come first
    proposed, first_children = 0, set()

    def drafting(context: list[int], size=None):
        nonlocal proposed
        tree = yield from type(inner).drafting(inner, context, size)
        proposed = len(tree)
        return tree

    def verify(root, tree, *args, **kwargs):  # the whole tree (a graft included): each parent's first child
        first_children.clear()
        first_children.update(kids[0] for kids in tree.children() if kids)
        return type(target).verify(target, root, tree, *args, **kwargs)

    def commit(path: list[int], slot: int = 0) -> None:
        seen.siblings += any(node not in first_children for node in path)
        seen.head_accepted += sum(node < proposed for node in path)
        type(target).commit(target, path, slot)

    inner.drafting, target.verify, target.commit = drafting, verify, commit  # recorded, then called as they are
    try:
        for prompt in prompts:
            stats = GenerationStats()
            ours = generate_ids(target, prompt, drafter, max_new_tokens=max_new_tokens, stats=stats)
            hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
            assert ours == hf[0, len(prompt) :].tolist(), f"differs from generate on prompt {prompt}"
            assert stats.new_tokens <= stats.target_passes + sum(stats.accepted_per_depth)  # = but for a cut last round
            seen.rounds += stats.target_passes
            seen.new_tokens += stats.new_tokens
            seen.accepted += sum(stats.accepted_per_depth)
    finally:
        del inner.drafting
    return seen


def assert_trained_heads_speculate(seen: Speculation, drafter: str, where: str = "") -> None:
    """Heads that predict their target, in a tree of several branches: a head drafter alone accepts 1.5 tokens a
    pass or more, with lookup grafted on some of the heads' own nodes are accepted. (Whether a round commits a
    rank > 0 branch is up to the heads: `SecondGuess` makes every round do so.)"""
    if drafter.endswith("+lookup"):
        assert seen.head_accepted > 0, f"{where} {drafter}: no node of the heads was accepted ({seen})"
    else:
        assert seen.acceptance_length >= 1.5, f"{where} {drafter}: {seen.acceptance_length:.2f} tokens a pass"


class SecondGuess(Drafter):
    """A drafter that knows the target's greedy continuation and always guesses it second: each node's first child
    is a wrong token, its second the right one, which carries the chain on (`depth` right tokens a round). Every
    round that accepts a draft token commits rank > 0 siblings, so the KV cache must move those rows."""

    name = "second-guess"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab_size: int, depth: int = 3) -> None:
        self.continuations, self.vocab_size, self.depth = continuations, vocab_size, depth
        self.prompt: tuple[int, ...] = ()

    def start(self, prompt_ids, prompt_hidden, sampling=None, seed=None) -> None:
        self.prompt = tuple(prompt_ids)

    def propose(self, context: list[int]):
        from headstart.runtime.tree import DraftTree

        done = len(context) - len(self.prompt)
        right = self.continuations[self.prompt][done : done + self.depth]
        tokens, parents, parent = [], [], -1
        for token in right:
            tokens += [(token + 1) % self.vocab_size, token]  # the wrong guess first, the right one second
            parents += [parent, parent]
            parent = len(tokens) - 1
        return DraftTree(tokens, parents)


def sampling_model(vocab: int = 8):
    """A tiny random Llama over a small vocabulary, peaked enough for drafts to be accepted often."""
    return tiny_llama(vocab_size=vocab, init_std=0.3, seed=3)


def first_three_joint(model, prompt: list[int], params: SamplingParams = SAMPLING) -> torch.Tensor:
    """Exact (V, V, V) distribution of the first three sampled tokens (one batched forward)."""
    vocab = model.config.vocab_size
    seqs = torch.tensor([prompt + list(pair) for pair in itertools.product(range(vocab), repeat=2)])
    with torch.no_grad():
        probs = target_probs(model(input_ids=seqs).logits[:, -3:], params)  # p(a), p(b|a), p(c|a,b)
    joint = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    for i, (a, b) in enumerate(itertools.product(range(vocab), repeat=2)):
        joint[a, b] = (probs[i, 0, a] * probs[i, 1, b] * probs[i, 2]).double()
    assert abs(joint.sum() - 1) < 1e-5
    return joint


def assert_first_three_follow_target(
    model,
    prompt: list[int],
    drafter: Drafter,
    runs: int = 3000,
    params: SamplingParams = SAMPLING,
    expect_drafts: bool = True,
) -> None:
    """`runs` seeded decodes of 3 tokens against the exact joint.

    Fails when a sequence of target probability 0 appears at all, or when the chi-square p-value is below
    1e-3: a correct implementation fails the latter with probability 0.1 % (the seeds are fixed, so the
    outcome is reproducible). With `expect_drafts`, also requires that
    drafts were accepted in at least a tenth of the runs, so the test exercises speculation.
    """
    joint = first_three_joint(model, prompt, params)
    target = Target(model)
    vocab = model.config.vocab_size
    counts = torch.zeros(vocab, vocab, vocab)
    drafted = 0
    for seed in range(runs):
        stats = GenerationStats()
        a, b, c = generate_ids(target, prompt, drafter, sampling=params, max_new_tokens=3, seed=seed, stats=stats)
        counts[a, b, c] += 1
        drafted += sum(stats.accepted_per_depth)
    assert drafted > runs // 10 if expect_drafts else drafted == 0
    impossible = int(counts[joint == 0].sum())  # not pooled into the chi-square's small cells: never allowed
    assert impossible == 0, f"{impossible} of {runs} runs wrote a sequence the target gives probability 0"
    assert chi_square_pvalue(counts, joint) > 1e-3


def train_tiny_heads(tmp_path, model_dir, kind: str, steps: int = 10, **overrides):
    """Heads trained for a few steps (on synthetic distilled rows unless `data.path` is given); returns the heads
    directory."""
    from headstart.train import recipe
    from helpers.training import make_cfg

    recipe.run(make_cfg(tmp_path, model_dir, kind, **{"optim.max_steps": steps, **overrides}))
    return tmp_path / "out" / "heads"


# heads fitted to their target's own greedy continuations (the rows distillation writes): a few dozen steps over
# 256 draft tokens make them predict it, so trees are accepted and several branches are used
# (EAGLE heads with their training-time test, so that depths past the first are right too; Medusa-2's LoRA slow,
# so that the adapted target still writes what the heads learnt from the rows)
FIT = {"optim.max_steps": 60, "optim.lr": 0.03, "heads.draft_vocab": 256, "data.eval_rows": 0, "save_every": 10**6}
FIT_KIND = {"eagle": {"heads.unroll": 3}, "eagle3": {"heads.unroll": 3}, "medusa2": {"heads.lora.lr": 1e-6}}
# the trees fitted heads draft: several branches a round, so that rounds can keep another branch than the first
TREES = {"medusa": {"budget": 12}, "eagle": {"top_k": 3, "depth": 4, "budget": 12}}
TREES["medusa2"], TREES["eagle3"] = TREES["medusa"], TREES["eagle"]


def fit_heads(root, model_dir, kind: str, rows, **overrides):
    """Heads of `kind` trained (by the trainer) on `rows`, the target's greedy (prompt, answer) pairs, for the
    model in `model_dir`; returns the heads directory. No row is held out (the heads are to predict these very
    continuations), so they carry no measured per-rank accuracies: Medusa trees take the prior's shape."""
    from helpers.training import write_rows

    write_rows(root / "data", rows)
    return train_tiny_heads(
        root, model_dir, kind, **{**FIT, **FIT_KIND.get(kind, {}), "data.path": root / "data", **overrides}
    )


def random_heads(kind: str, model, std: float, seed: int = 0, **options):
    """Heads with random (untrained) weights: exactness must not depend on the heads' quality."""
    from headstart.heads.checkpoint import build_heads

    torch.manual_seed(seed)
    heads = build_heads(kind, model, **options)
    for p in heads.parameters():
        p.data.normal_(0, std)
    return heads.eval().requires_grad_(False)


def assert_identity_with_trained_heads(
    tmp_path, model_dir, kind: str, trees: list[dict], drafter: str | None = None, **overrides
) -> None:
    """Heads trained for a few steps on the tiny model in `model_dir`: greedy identity for each tree setting
    of the `drafter` that uses them (default: `kind`)."""
    from headstart.runtime.drafters.registry import make_drafter
    from headstart.runtime.models import load_model

    heads_dir = train_tiny_heads(tmp_path, model_dir, kind, **overrides)
    model, tokenizer = load_model(str(model_dir))
    model.generation_config.eos_token_id = None
    prompts = [[3, 4, 5, 6, 3, 4], [10, 11, 12, 13, 14, 15, 16], [20, 21]]
    for tree in trees:
        decoder = make_drafter(drafter or kind, model, tokenizer, heads=str(heads_dir), **tree)
        assert assert_greedy_identity(model, decoder, prompts).accepted > 0, f"no draft accepted with {tree}"
