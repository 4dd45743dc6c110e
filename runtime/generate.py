"""The one decode loop: draft a tree, verify it in one target forward, accept a path, commit, stream.

Plain decoding is this loop with the base `Drafter` (empty trees): one forward per token. Every
speedup headstart reports is measured against it; batch, CLI, server and benchmark code consume it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from headstart.runtime.accept import accept_path
from headstart.runtime.drafters.base import Drafter
from headstart.runtime.sampling import Rng, SamplingParams
from headstart.runtime.target import Target
from headstart.runtime.tree import DraftTree

# a round, in order (`stream`); layers + lm_head = the target forward (lm_head measured under `Target.timing_lm_head`)
PHASES = ("propose", "mask", "layers", "lm_head", "accept", "commit", "observe")


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_passes: int = 0  # verification forwards (the prefill not counted)
    plain_passes: int = 0  # of those, passes with nothing drafted (an empty tree)
    accepted_per_depth: list[int] = field(default_factory=list)  # [d-1]: rounds whose path reached depth d
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forward + accept_path + cache commit
    elapsed_s: float = 0.0  # prefill to last token
    prefill_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=dict)  # seconds per phase of the rounds (PHASES)

    @property
    def acceptance_length(self) -> float:
        """tau: tokens produced per target verification pass."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def as_dict(self) -> dict:
        rounds = max(self.target_passes, 1)
        return {
            "acceptance_length": round(self.acceptance_length, 4),
            "target_passes": self.target_passes,
            "new_tokens": self.new_tokens,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "accepted_per_depth": list(self.accepted_per_depth),
            "draft_ms": round(1e3 * self.draft_s / rounds, 3),
            "verify_ms": round(1e3 * self.verify_s / rounds, 3),
        }


@dataclass
class Chunk:
    tokens: list[int]  # new tokens of one round, in order
    drafted: int  # how many of them (the first ones) were draft tokens the target accepted


def stream(
    target: Target,
    prompt_ids: list[int],
    drafter: Drafter | None = None,
    sampling: SamplingParams | None = None,
    max_new_tokens: int = 128,
    eos_ids: frozenset[int] | set[int] = frozenset(),
    seed: int | None = None,
    stats: GenerationStats | None = None,
) -> Iterator[Chunk]:
    """Yield the tokens generated after `prompt_ids`, a round at a time, stopping at EOS (yielded) or the limit.

    Pass a `GenerationStats` to read the per-request statistics as the stream goes on.
    """
    if not prompt_ids:
        raise ValueError("empty prompt")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if len(prompt_ids) + max_new_tokens > target.max_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {target.max_len} tokens"
        )
    drafter = drafter or Drafter()
    sampling = sampling or SamplingParams()
    stats = stats if stats is not None else GenerationStats()
    rng = Rng(seed, device=target.device)
    t_start = time.perf_counter()

    prompt_hidden = target.prefill(prompt_ids[:-1], drafter.feature_layers)
    drafter.start(prompt_ids, prompt_hidden, sampling, seed)
    stats.prefill_s = time.perf_counter() - t_start
    phase = stats.phase_s
    for name in PHASES:
        phase.setdefault(name, 0.0)
    context = list(prompt_ids)  # the last token is the root: not yet in the KV cache
    while stats.new_tokens < max_new_tokens:
        t0 = time.perf_counter()
        tree = drafter.propose(context)
        if target.past_len + len(tree) + 1 > target.max_len:
            tree = DraftTree()  # no room left for a tree at the end of the context
        t1 = time.perf_counter()
        verified = target.verify(context[-1], tree, drafter.feature_layers)
        t_verified = time.perf_counter()
        accepted = accept_path(tree, verified.logits, sampling, rng)
        t_accepted = time.perf_counter()
        target.commit(accepted.path)
        t2 = time.perf_counter()
        drafter.observe(tree, accepted.path, verified.hidden, accepted.next_token)
        t3 = time.perf_counter()
        phase["propose"] += t1 - t0
        phase["mask"] += verified.mask_s
        phase["layers"] += t_verified - t1 - verified.mask_s - verified.lm_head_s
        phase["lm_head"] += verified.lm_head_s
        phase["accept"] += t_accepted - t_verified
        phase["commit"] += t2 - t_accepted
        phase["observe"] += t3 - t2

        new = [tree.tokens[i] for i in accepted.path] + [accepted.next_token]
        new = new[: max_new_tokens - stats.new_tokens]
        stop = next((i for i, tok in enumerate(new) if tok in eos_ids), None)
        if stop is not None:
            new = new[: stop + 1]
        drafted = min(len(accepted.path), len(new))

        stats.target_passes += 1
        stats.plain_passes += not tree
        stats.new_tokens += len(new)
        stats.draft_s += (t1 - t0) + (t3 - t2)  # proposing, and updating the drafter's state
        stats.verify_s += t2 - t1
        if len(stats.accepted_per_depth) < drafted:
            stats.accepted_per_depth.extend([0] * (drafted - len(stats.accepted_per_depth)))
        for depth in range(drafted):
            stats.accepted_per_depth[depth] += 1
        stats.elapsed_s = time.perf_counter() - t_start
        context.extend(new)
        yield Chunk(new, drafted)
        if stop is not None:
            return
