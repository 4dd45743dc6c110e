"""The one decode loop, for B sequences: draft a tree per sequence, verify them in one target forward, accept a
path per sequence, commit, stream.

`Batch.round` is a round; batch 1 is a batch of one (`stream`). Sequences join and leave between rounds
(continuous batching): a joiner's prompt is prefilled whole while nothing decodes, else in chunks of at most
`prefill_chunk` tokens a round, so the running streams keep their pace (a short prompt, at most `WHOLE_PREFILL`
chunks, takes one round); the chunks ride in the round's forward where the target can (`Target.mixes_prefill`),
the last one with the prompt's last token, whose logits give the joiner's first token in that round. Each sequence
has its own sampling parameters, random stream, drafter, limits and statistics; its tokens depend on its own draws
only (at T = 0 its greedy tokens, at T > 0 the target's distribution: `runtime/accept.py`). Plain decoding is this
loop with the base `Drafter` (empty trees): one forward per token. Every speedup headstart reports is measured
against it; the engine, the server, the bench and distillation (`decode_all`) consume it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from headstart.runtime.accept import accept_path
from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.together import propose_all
from headstart.runtime.prefix_cache import BLOCK, PrefixCache, restore
from headstart.runtime.sampling import Rng, SamplingParams
from headstart.runtime.target import Prefill, Target, Verified, features
from headstart.runtime.tree import DraftTree

if TYPE_CHECKING:
    from headstart.runtime.sizing.planner import Planner

# a round, in order (`stream`); stage: the joiners' prompt chunks that ride in its forward picked (batching, not
# drafting); layers + lm_head = the target forward (lm_head measured under `Target.timing_lm_head`)
PHASES = ("stage", "propose", "mask", "layers", "lm_head", "accept", "commit", "observe")


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_passes: int = 0  # verification forwards (the prefill not counted)
    plain_passes: int = 0  # of those, passes with nothing drafted (an empty tree)
    accepted_per_depth: list[int] = field(default_factory=list)  # [d-1]: rounds whose path reached depth d
    draft_tokens: int = 0  # tree nodes verified (every node of every tree)
    accepted_histogram: list[int] = field(default_factory=list)  # [k]: speculative rounds that accepted k nodes
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forward + accept_path + cache commit
    elapsed_s: float = 0.0  # prefill to last token
    prefill_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=dict)  # seconds per phase of the rounds (PHASES)
    treeless_phase_s: dict[str, float] = field(default_factory=dict)  # of those, rounds where no sequence drafted

    @property
    def acceptance_length(self) -> float:
        """tau: tokens produced per target verification pass."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def spec_steps(self) -> int:
        """Rounds that verified a tree."""
        return self.target_passes - self.plain_passes

    @property
    def accepted_tokens(self) -> int:
        """Tree nodes accepted, all rounds together."""
        return sum(self.accepted_per_depth)

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

    def spec_decode(self) -> dict:
        """vLLM's per-request `metrics.speculative_decoding` summary: a step is a round with a tree, its draft
        tokens are the tree's nodes (all verified in its one forward), its accepted ones the nodes of the path
        (`accepted_per_depth` adds them by tree depth)."""
        steps, accepted = self.spec_steps, self.accepted_tokens
        return {
            "num_spec_steps": steps,
            "num_draft_tokens": self.draft_tokens,
            "num_accepted_draft_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
            "draft_acceptance_rate": accepted / self.draft_tokens if self.draft_tokens else 0.0,
            "acceptance_histogram": list(self.accepted_histogram),
            "accepted_per_depth": list(self.accepted_per_depth),
        }


@dataclass
class Chunk:
    tokens: list[int]  # new tokens of one round, in order
    drafted: int  # how many of them (the first ones) were draft tokens the target accepted


@dataclass(eq=False)
class Request:
    """One sequence of a batch: what it asks for, and where the loop stands with it."""

    prompt_ids: list[int]
    drafter: Drafter = field(default_factory=Drafter)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    eos_ids: frozenset[int] | set[int] = frozenset()
    seed: int | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    owner: object = None  # whoever asked for it (the server's job)
    context: list[int] = field(default_factory=list)  # prompt + new tokens; the last is the root
    done: bool = False
    slot: int = -1  # its row of the target's cache while it is in the batch
    cached: int = 0  # prompt tokens prefilled so far (ready at all but the last, or all where chunks ride in rounds)
    whole: bool = False  # short enough to be prefilled in one round while others decode
    features: list[torch.Tensor] = field(default_factory=list)  # the prompt's, chunk by chunk, for `drafter.start`
    prompt_features: torch.Tensor | None = None  # (prompt - 1, F) once started, kept for a prefix cache
    rng: Rng | None = None
    t_start: float = 0.0


@dataclass
class SharedPrefix:
    """Tokens most prompts start with (a chat template's system turn), cached once: keys, values and hidden
    states, copied into each sequence that starts with them instead of computed again."""

    ids: list[int]
    kv: list | None = None
    hidden: torch.Tensor | None = None  # (layers + 1, P, H): every hidden state

    @classmethod
    def common(cls, prompts: Sequence[list[int]]) -> SharedPrefix | None:
        """The tokens every prompt starts with, short of each one's last token (a round feeds that); None if none."""
        first = prompts[0]
        n = min(map(len, prompts)) - 1
        for ids in prompts:
            while n and ids[:n] != first[:n]:
                n -= 1
        return cls(list(first[:n])) if n else None


class Phases:
    """Seconds of a round's phases: `lap(name)` closes the phase that ran since the last lap."""

    def __init__(self) -> None:
        self.t, self.s = time.perf_counter(), {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.s[name], self.t = now - self.t, now


class Batch:
    """The decode loop over the sequences in `target`'s slots (at most `target.slots` at once).

    `prefill_chunk`: prompt tokens a round prefills while others decode (None: `PREFILL_CHUNK`); `kv_budget`:
    bytes the KV cache may hold (None: no limit), a joiner waits until it fits; `prefix`: a shared prefix;
    `prefix_cache`: leavers' prompts kept, joiners' starts copied from it (`runtime/prefix_cache.py`; None: none);
    `planner`: sizes every decoding sequence's tree before each round (`plan`: from their drafters, their contexts, this
    round's prefill seconds, the joiners waiting for a prefill, and whether the last round's time is a sample of a
    round's cost), the sizes handed to `propose_all`; it is told what the round committed and how long its drafting took
    (`observe`) (`runtime/sizing/planner.Planner`; None: each drafter drafts its own tree). `mix`: while others decode,
    joiners' prompt chunks ride in the round's forward (`Target.verify_batch`'s prefills; None: where the target can,
    `Target.mixes_prefill`), else each chunk is a forward of its own before the round."""

    def __init__(
        self,
        target: Target,
        prefill_chunk: int | None = None,
        kv_budget: int | None = None,
        prefix: SharedPrefix | None = None,
        planner: Planner | None = None,
        mix: bool | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.target, self.kv_budget, self.prefix, self.planner = target, kv_budget, prefix, planner
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk or PREFILL_CHUNK
        self.mix = target.mixes_prefill if mix is None else mix
        self.decoding: list[Request] = []  # in slots 0, 1, ...
        # the time since the last plan is a sample of a round's cost: not before this batch's first round (the
        # planner's last plan was another batch's: `headstart bench` ran the other methods in between), nor after an
        # empty round (a server's idle wait), nor after a round whose forward carried a joiner's prompt chunk
        self._sample = False
        self.joining: list[Request] = []  # waiting, the first one prefilling in the slot after the decoding ones

    def __len__(self) -> int:
        return len(self.decoding) + len(self.joining)

    def add(self, request: Request) -> Request:
        """`request` joins at the next round (its prompt checked now: ValueError)."""
        check_request(self.target, request.prompt_ids, request.max_new_tokens)
        request.context, request.rng = list(request.prompt_ids), Rng(request.seed, device=self.target.device)
        self.joining.append(request)
        return request

    @torch.inference_mode()
    def remove(self, request: Request) -> None:
        """`request` leaves now (its client went away, its time ran out): its slot is free for the next round."""
        request.done = True
        if request in self.joining:
            self.joining.remove(request)
        elif request in self.decoding:  # the last decoding sequence takes its slot: one cache moves
            self._keep(request)
            i = self.decoding.index(request)
            self.decoding[i] = self.decoding[-1]
            self.decoding.pop()
        else:
            return  # gone already
        request.drafter.finish(request.context)  # once: what it wrote, for drafters that learn from traffic
        self._compact()

    @torch.inference_mode()
    def round(self) -> list[tuple[Request, Chunk]]:
        """Admit and prefill joiners, then one round for every decoding sequence: its new tokens (and those of a
        joiner whose prompt's last chunk rode in the round)."""
        t0 = time.perf_counter()
        self._prefill()
        prefill_s = time.perf_counter() - t0
        live = list(self.decoding)
        if not live:
            self._sample = False
            return []
        target, phases = self.target, Phases()
        staged = self._stage() if self.mix else []
        phases.lap("stage")
        drafters, contexts = [r.drafter for r in live], [r.context for r in live]
        sizes = None  # each drafter its own tree
        if self.planner is not None:
            waiting = min(len(self.joining), self.target.slots - len(live))  # joiners with a slot, not yet decoding
            sizes = self.planner.plan(drafters, contexts, prefill_s, waiting, self._sample)
        self._sample = not staged
        trees = propose_all(drafters, contexts, sizes)  # heads' forwards batched
        trees = [
            t if target.lengths[r.slot] + len(t) + 1 <= target.max_len else DraftTree()
            for r, t in zip(live, trees, strict=True)
        ]
        phases.lap("propose")
        layers = _feature_layers(live + [r for r, _ in staged])
        prefills = [
            Prefill(r.slot, r.prompt_ids[r.cached : r.cached + n], r.cached + n == len(r.prompt_ids)) for r, n in staged
        ]
        verified = target.verify_batch([r.context[-1] for r in live], trees, layers, prefills)
        verified, chunks = verified[: len(live)], verified[len(live) :]
        phases.lap("verify")
        accepted = [accept_path(t, v.logits, r.sampling, r.rng) for r, t, v in zip(live, trees, verified, strict=True)]
        phases.lap("accept")
        for r, a in zip(live, accepted, strict=True):
            target.commit(a.path, r.slot)
        phases.lap("commit")
        for r, t, v, a in zip(live, trees, verified, accepted, strict=True):
            r.drafter.observe(t, a.path, _own(v.hidden, r.drafter, layers), a.next_token)
        phases.lap("observe")
        if self.planner is not None:
            self.planner.observe(sum(len(a.path) + 1 for a in accepted), phases.s["propose"])
        split = _split_verify(phases.s, verified[0])  # the forward's mask and lm_head seconds are the batch's
        treeless = not any(trees)
        out = [(r, _emit(r, t, a, phases.s, split, treeless)) for r, t, a in zip(live, trees, accepted, strict=True)]
        for (r, n), p, v in zip(staged, prefills, chunks, strict=True):
            out += self._joined(r, n, p.last, v, layers, phases.s, split, treeless)
        for r, _ in out:
            if r.done:
                self.remove(r)
        return out

    def _stage(self, root: bool = True) -> list[tuple[Request, int]]:
        """Joiners whose prompt tokens are prefilled this round while others decode, in order, each taking the slot
        after the decoding and staged ones: (joiner, tokens). `prefill_chunk` tokens a round in all, or one short
        prompt (<= WHOLE_PREFILL chunks) whole. `root`: a prompt's last chunk includes its last token, the
        joiner's first root (they ride in the round's forward: it leaves this round with its first token); else
        they stop short of it (a forward of their own before the round)."""
        staged: list[tuple[Request, int]] = []
        budget = self.prefill_chunk
        for r in self.joining:
            if len(self.decoding) + len(staged) >= self.target.slots or not self._fits(r, [s for s, _ in staged]):
                break
            if r.slot < 0:
                self._admit(r, len(self.decoding) + len(staged))
                r.whole = len(r.prompt_ids) - 1 - r.cached <= WHOLE_PREFILL * self.prefill_chunk
            todo = len(r.prompt_ids) - r.cached - (not root)
            take = todo if r.whole and budget == self.prefill_chunk else min(todo, budget)  # whole: alone this round
            staged.append((r, take))
            budget -= take
            if take < todo or budget <= 0:
                break
        return staged

    def _joined(
        self,
        r: Request,
        n: int,
        last: bool,
        v: Verified,
        layers: tuple[int, ...],
        phase: dict,
        split: dict,
        treeless: bool,
    ) -> list[tuple[Request, Chunk]]:
        """After a round that fed `n` of joiner `r`'s prompt tokens: their features kept; where they ended the
        prompt, its drafter starts (the prompt's features but its root's), sees the root's round (a plain one: no
        tree) and the joiner decodes from the next round with the first token drawn from the root's logits."""
        own = _own(v.hidden, r.drafter, layers)  # (n, F) or None
        r.cached += n
        if not last:
            r.features += [] if own is None else [own]
            return []
        r.features += [] if own is None or n == 1 else [own[:-1]]
        self.joining.remove(r)
        self._ready(r)
        if r.max_new_tokens == 0:
            r.done = True
            return [(r, Chunk([], 0))]
        a = accept_path(DraftTree(), v.logits, r.sampling, r.rng)
        r.drafter.observe(DraftTree(), [], None if own is None else own[-1:], a.next_token)
        return [(r, _emit(r, DraftTree(), a, phase, split, treeless))]

    def _prefill(self) -> None:
        """Admit joiners in order while a slot is free and the cache fits them. While nothing decodes, every joiner
        admitted is prefilled whole, prompts of similar lengths in one forward; else, unless the chunks ride in the
        round (`mix`), `_stage`'s chunks are prefilled here, each in a forward of its own. A joiner whose prompt is
        cached decodes."""
        if not self.decoding:
            admitted: list[Request] = []
            while self.joining and len(admitted) < self.target.slots and self._fits(self.joining[0], admitted):
                r = self.joining.pop(0)
                admitted.append(r if r.slot >= 0 else self._admit(r, len(admitted)))  # >= 0: part prefilled, slot 0
            for group in _similar(admitted):
                layers = _feature_layers(group)
                chunks = [r.prompt_ids[r.cached : -1] for r in group]
                found = self.target.extend_batch(chunks, group[0].slot, layers)
                for r, chunk, hidden in zip(group, chunks, found, strict=True):
                    own = _own(hidden, r.drafter, layers)  # None for a drafter that reads no features
                    r.features += [] if own is None else [own]
                    r.cached += len(chunk)
            for r in admitted:
                self._ready(r)
            for r in admitted:
                if r.max_new_tokens == 0:
                    self.remove(r)
            return
        if self.mix:
            return  # the joiners' chunks ride in the round's forward (`_stage`)
        staged = self._stage(root=False)
        for r, take in staged:
            if take:
                hidden = self.target.extend(r.prompt_ids[r.cached : r.cached + take], r.drafter.feature_layers, r.slot)
                r.features += [] if hidden is None else [hidden]
                r.cached += take
            if r.cached == len(r.prompt_ids) - 1:
                self.joining.remove(r)
                self._ready(r)
        for r, _ in staged:
            if r.max_new_tokens == 0 and r in self.decoding:
                self.remove(r)

    def _admit(self, r: Request, slot: int) -> Request:
        """`r` takes `slot`, the shared prefix copied in."""
        r.slot, r.t_start = slot, time.perf_counter()
        self._start_prefix(r)
        return r

    def _ready(self, r: Request) -> None:
        """`r`'s prompt is cached: its drafter starts, it decodes from the next round."""
        features = torch.cat(r.features) if r.features else None
        r.features = []
        if self.prefix_cache is not None:
            r.prompt_features = features
        r.drafter.start(r.prompt_ids, features, r.sampling, r.seed)
        r.stats.prefill_s = time.perf_counter() - r.t_start
        for name in PHASES:
            r.stats.phase_s.setdefault(name, 0.0)
            r.stats.treeless_phase_s.setdefault(name, 0.0)
        self.decoding.append(r)

    def _start_prefix(self, r: Request) -> None:
        """Copy the longest start of `r`'s prompt held into its slot: the prefix cache's blocks (they leave at least
        one prompt token to compute besides the last, the root), or the shared prefix (computed on first use) when
        its prompt starts with it."""
        self.target.lengths[r.slot] = 0
        p, cache, layers = self.prefix, self.prefix_cache, r.drafter.feature_layers
        shared = p is not None and len(p.ids) < len(r.prompt_ids) and r.prompt_ids[: len(p.ids)] == p.ids
        if cache is not None and layers == cache.layers:
            blocks = cache.match(r.prompt_ids, len(r.prompt_ids) - 2)
            if blocks and (not shared or len(blocks) * BLOCK >= len(p.ids)):
                kv, held = restore(blocks)
                self.target.cache.restore(r.slot, kv)
                r.cached = self.target.lengths[r.slot] = len(blocks) * BLOCK
                r.features += [] if held is None else [held]
                return
        if not shared:
            return
        if p.kv is None:
            p.hidden = self.target.extend(p.ids, None, r.slot)  # (layers + 1, P, H)
            p.kv = self.target.cache.snapshot(r.slot, len(p.ids))
        else:
            self.target.cache.restore(r.slot, p.kv)
            self.target.lengths[r.slot] = len(p.ids)
        r.cached = len(p.ids)
        if layers:
            r.features.append(features(tuple(p.hidden[:, None]), layers)[0])

    def _keep(self, r: Request) -> None:
        """A leaver's prompt into the prefix cache: its slot holds the prompt's rows, `r` their features (None only
        for a one-token prompt, which keeps no block)."""
        cache = self.prefix_cache
        if cache is None or r.drafter.feature_layers != cache.layers:
            return
        ids = r.prompt_ids[:-1]  # positions with features: the root's came with its round
        cache.keep(ids, lambda start, stop: self.target.cache.snapshot(r.slot, stop, start), r.prompt_features)

    def _fits(self, r: Request, admitted: Sequence[Request] = ()) -> bool:
        """The cache, grown for one more sequence of `r`'s length (beside the `admitted` ones), stays within
        `kv_budget`."""
        if self.kv_budget is None or r.slot >= 0:
            return True
        held = [*self.decoding, *admitted, r]
        longest = max(len(x.prompt_ids) + x.max_new_tokens for x in held)
        return kv_bytes(self.target, len(held), longest) <= self.kv_budget

    def _compact(self) -> None:
        """Keep the decoding sequences in slots 0, 1, ... and a prefilling joiner right after them."""
        prefilling = [r for r in self.joining[:1] if r.slot >= 0]
        for i, r in enumerate(self.decoding + prefilling):
            if r.slot != i:
                self.target.move(r.slot, i)
                r.slot = i
        if not len(self):
            self.target.cache.release()


PREFILL_CHUNK = 64  # prompt tokens prefilled per round while others decode (docs/serving.md: measured)
WHOLE_PREFILL = 8  # a joiner with at most this many chunks to prefill takes one round (short prompts join at once)


def kv_bytes(target: Target, sequences: int, longest: int) -> int:
    """What the cache may grow to for `sequences` slots whose longest holds `longest` tokens: every slot is as wide
    as the widest, and a buffer grows by doubling (so up to twice what it holds)."""
    return sequences * 2 * longest * target.kv_bytes_per_token()


PREFILL_TOKENS = 8192  # padded tokens a batched prefill forward feeds at most


def _similar(joiners: list[Request]) -> Iterator[list[Request]]:
    """Consecutive joiners (in slot order) in groups one prefill forward takes: similar lengths (padding to the
    longest costs little), at most PREFILL_TOKENS padded tokens. A joiner whose prompt is cached up to its root (the
    shared prefix and one token) needs no forward: it ends a group (an empty chunk crashed the forward)."""
    group: list[Request] = []
    for r in joiners:
        if r.cached == len(r.prompt_ids) - 1:
            if group:
                yield group
            group = []
            continue
        todo = [len(x.prompt_ids) - 1 - x.cached for x in [*group, r]]
        if group and (max(todo) * len(todo) > PREFILL_TOKENS or max(todo) > 1.25 * min(todo) + 8):
            yield group
            group = []
        group.append(r)
    if group:
        yield group


def check_request(target: Target, prompt_ids: list[int], max_new_tokens: int) -> None:
    if not prompt_ids:
        raise ValueError("empty prompt")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if len(prompt_ids) + max_new_tokens > target.max_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {target.max_len} tokens"
        )


def _feature_layers(live: list[Request]) -> tuple[int, ...]:
    """The hidden states the round's forward returns: every drafter's, in one order (most ask for one set)."""
    wanted: list[int] = []
    for r in live:
        wanted += [k for k in r.drafter.feature_layers if k not in wanted]
    return tuple(wanted)


def _own(hidden: torch.Tensor | None, drafter: Drafter, layers: tuple[int, ...]) -> torch.Tensor | None:
    """The features `drafter` asked for out of the round's `layers` (concatenated in that order)."""
    if hidden is None or not drafter.feature_layers:
        return None
    if drafter.feature_layers == layers:
        return hidden
    width = hidden.shape[-1] // len(layers)
    return torch.cat(
        [hidden[..., layers.index(k) * width : (layers.index(k) + 1) * width] for k in drafter.feature_layers], -1
    )


def _emit(
    r: Request, tree: DraftTree, accepted, phase: dict[str, float], split: dict[str, float], treeless: bool
) -> Chunk:
    """The round's new tokens of `r` (cut at EOS and the limit), its statistics updated (`treeless`: no sequence
    drafted in the round)."""
    new = [tree.tokens[i] for i in accepted.path] + [accepted.next_token]
    new = new[: r.max_new_tokens - r.stats.new_tokens]
    stop = next((i for i, tok in enumerate(new) if tok in r.eos_ids), None)
    if stop is not None:
        new = new[: stop + 1]
    drafted = min(len(accepted.path), len(new))
    stats = r.stats
    stats.target_passes += 1
    stats.plain_passes += not tree
    if tree:
        stats.draft_tokens += len(tree)
        stats.accepted_histogram.extend([0] * (drafted + 1 - len(stats.accepted_histogram)))
        stats.accepted_histogram[drafted] += 1
    stats.new_tokens += len(new)
    for name, seconds in split.items():
        stats.phase_s[name] += seconds
        if treeless:
            stats.treeless_phase_s[name] += seconds
    stats.draft_s += phase["propose"] + phase["observe"]  # proposing, and updating the drafter's state
    stats.verify_s += phase["verify"] + phase["accept"] + phase["commit"]
    if len(stats.accepted_per_depth) < drafted:
        stats.accepted_per_depth.extend([0] * (drafted - len(stats.accepted_per_depth)))
    for depth in range(drafted):
        stats.accepted_per_depth[depth] += 1
    stats.elapsed_s = time.perf_counter() - r.t_start
    r.context.extend(new)
    r.done = stop is not None or stats.new_tokens >= r.max_new_tokens
    return Chunk(new, drafted)


def _split_verify(phase: dict[str, float], verified) -> dict[str, float]:
    """The round's phases as `PHASES` names them: the verify forward split into mask, layers and lm_head."""
    layers = phase["verify"] - verified.mask_s - verified.lm_head_s
    split = {**phase, "mask": verified.mask_s, "layers": layers, "lm_head": verified.lm_head_s}
    return {name: split[name] for name in PHASES}


def decode_all(target: Target, requests: Iterable[Request], prefix: SharedPrefix | None = None) -> Iterator[Request]:
    """Decode `requests` in one batch of `target.slots` sequences, the next one joining as soon as one leaves;
    yield each as it finishes (offline work: distillation)."""
    batch = Batch(target, prefix=prefix)
    pending = iter(requests)
    following = next(pending, None)
    while following is not None or len(batch):
        while following is not None and len(batch) < target.slots:
            batch.add(following)
            following = next(pending, None)
        for r, _ in batch.round():
            if r.done:
                yield r


def stream(
    target: Target,
    prompt_ids: list[int],
    drafter: Drafter | None = None,
    sampling: SamplingParams | None = None,
    max_new_tokens: int = 128,
    eos_ids: frozenset[int] | set[int] = frozenset(),
    seed: int | None = None,
    stats: GenerationStats | None = None,
    prefix_cache: PrefixCache | None = None,
    planner=None,
) -> Iterator[Chunk]:
    """Yield the tokens generated after `prompt_ids`, a round at a time, stopping at EOS (yielded) or the limit:
    a batch of one. Pass a `GenerationStats` to read the per-request statistics as the stream goes on; a
    `prefix_cache` to start from the blocks of earlier prompts it holds and keep this one's (as a server does); a
    `planner` to size the tree as the server's does (`Batch`)."""
    batch = Batch(target, prefix_cache=prefix_cache, planner=planner)
    request = batch.add(
        Request(
            prompt_ids,
            drafter or Drafter(),
            sampling or SamplingParams(),
            max_new_tokens,
            eos_ids,
            seed,
            stats if stats is not None else GenerationStats(),
        )
    )
    while not request.done:
        for _, chunk in batch.round():
            yield chunk
