"""Drafts from the server's own traffic: a pool of finished requests (prompt and output), shared by every request.

Prompt lookup copies what the request itself read; traffic repeats across requests too (the same instruction and
JSON schema over many documents, an agent re-sending its tools and formats, the same questions). `SuffixPool`
keeps the token ids of finished requests, oldest dropped first past `max_tokens`, indexed by every NGRAM-token
window. A lookup takes the windows equal to the context's last NGRAM tokens, extends each match backwards (up to
`max_match` tokens, never across a request's start), keeps the `max_matches` longest (the most recent first
among equals) and counts what followed each, as far as the match is long (a match of m tokens: up to
max(branch_len, spec_factor * m) tokens, at most `max_spec`; SuffixDecoding's rule: the longer the context
repeats, the further its continuation is trusted): a trie of continuations where a node's count is how many
matches went through it. A node's estimated probability is its count over the matches + 1, times the pool's
calibration at its depth (`SuffixPool.factors`: of the nodes that deep in the trees drafted from the pool alone,
those accepted over the count-based estimates, which a long branch of matches that all agree overrates the
deeper it runs), and never more than its parent's; the draft is the `pool_nodes` likeliest nodes whose
probability reaches `min_prob`, parents first, so any first n of them form the likeliest tree of n nodes.

`SuffixDrafter` (`--drafter suffix`) drafts the request's own prompt-lookup branches and the pool's, in turn (what
the request repeats of itself is found as before; the pool adds what other requests wrote); `X+suffix` grafts them
onto X's tree (`graft.LookupGraft`), or drafts the pool's tree with the request's own branches while X rests (its
head forwards and its nodes' rows saved): under the load budget where that plan is worth more, in fixed trees
where the pool's nodes expect `alone_gain` accepted nodes or more (on the agent workload the pool's trees were
drafted alone in most rounds). Exact as every drafter: the pool holds requests
that finished before this round, so a tree never depends on this round's draws (`accept_path` is exact for any
proposal that does not). The pool is one tenant's: a request can learn from how fast it is answered what others
asked (a timing side channel), so a server shared by parties who must not see each other's traffic runs
`--no-suffix-pool` (docs/serving.md): `pool_tokens` 0, no pool, the request's own lookup alone. A server's /metrics
shows the pool's size, hits, calibration and lookup cost (`SuffixPool.stats`).
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from headstart.runtime.drafters.lookup import LookupDrafter
from headstart.runtime.drafters.options import SuffixOptions
from headstart.runtime.tree import DraftTree

NGRAM = 3  # tokens a window of the index holds: a match is at least this long
SEP = -1  # between requests in the pool's buffer: no match extends across it
RECENT = 1024  # lookups whose durations the pool keeps (its lookup cost's p95)
PRIOR = 8.0  # nodes' worth of rounds the pool's calibration starts from, as if they were accepted as estimated
DEPTHS = 32  # depths the calibration keeps apart (deeper nodes share the last; `SuffixOptions.max_spec`'s default)


class Continuations(NamedTuple):
    """The pool's answer (`SuffixPool.lookup`): the chosen nodes as token paths from the root, likeliest first and
    parents before children, each one's estimated probability, and that estimate before the calibration."""

    paths: list[tuple[int, ...]]
    probs: list[float]
    raw: list[float]  # matches through the node over matches + 1
    matches: int  # how many earlier occurrences were counted
    longest: int  # the longest match's length in tokens

    @property
    def gain(self) -> float:
        """The nodes a round drafting them is expected to accept: the sum of their probabilities."""
        return sum(self.probs)

    @property
    def branches(self) -> list[list[int]]:
        """Root-to-leaf token paths of the chosen nodes, the likeliest leaf first (by its path's probabilities)."""
        prob = dict(zip(self.paths, self.probs, strict=True))
        parents = {path[:-1] for path in self.paths}
        leaves = [path for path in self.paths if path not in parents]
        leaves.sort(key=lambda path: [-prob[path[:d]] for d in range(1, len(path) + 1)])
        return [list(path) for path in leaves]

    def tree(self) -> DraftTree:
        """The chosen nodes as a tree, in their order (its first n nodes: the likeliest tree of n nodes)."""
        index: dict[tuple[int, ...], int] = {}
        for path in self.paths:
            index[path] = len(index)
        return DraftTree([path[-1] for path in self.paths], [index.get(path[:-1], -1) for path in self.paths])


NOTHING = Continuations([], [], [], 0, 0)


class SuffixPool:
    """Token ids of finished requests, FIFO past `max_tokens`, with an index of their NGRAM-token windows.
    Thread-safe (one lock: a server's worker adds and looks up; nothing stops other threads doing the same)."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"a suffix pool holds >= 1 token, got {max_tokens}")
        self.max_tokens = max_tokens
        self.buf = array("q")  # tokens, SEP before every request; buf[0] is position `base`
        self.base = 0  # the global position of buf[0] (positions only grow: the index survives eviction)
        self.starts: deque[int] = deque()  # global positions where each held request starts
        self.index: dict[int, list[int]] = {}  # window key -> global positions just after it, oldest first
        self.entries = 0  # positions in the index, those of dropped requests included until they go
        self.lock = threading.Lock()
        self.requests = 0  # held or not, every one added
        self.lookups, self.hits = 0, 0  # lookups; those that found a match of `min_match` tokens or more
        self.lookup_s = 0.0  # seconds of every lookup
        self.recent: deque[float] = deque(maxlen=RECENT)  # seconds of the last RECENT lookups
        # nodes of its trees drafted alone, by depth (the last: that deep or deeper): estimated (before the
        # calibration), then accepted; the factors on the estimates they make (`factors`)
        self.expected, self.accepted = [0.0] * DEPTHS, [0] * DEPTHS
        self.factors: tuple[float, ...] = (1.0,) * DEPTHS

    def __len__(self) -> int:
        return len(self.buf) - len(self.starts)

    def clear(self) -> None:
        """Forget every request (the counters too)."""
        with self.lock:
            self.base += len(self.buf)
            self.buf, self.starts, self.index, self.entries = array("q"), deque(), {}, 0
            self.requests, self.lookups, self.hits, self.lookup_s = 0, 0, 0, 0.0
            self.expected, self.accepted, self.factors = [0.0] * DEPTHS, [0] * DEPTHS, (1.0,) * DEPTHS
            self.recent.clear()

    def add(self, tokens: list[int]) -> None:
        """Hold a finished request's tokens (its prompt and output): index it, drop the oldest past the cap."""
        tokens = tokens[-self.max_tokens :]
        with self.lock:
            self.buf.append(SEP)
            start = self.base + len(self.buf)
            self.starts.append(start)
            self.buf.extend(tokens)
            self._index(tokens, start)
            self.requests += 1
            while len(self) > self.max_tokens:
                self._drop_oldest()

    def _index(self, tokens, start: int) -> None:
        for i in range(len(tokens) - NGRAM + 1):
            self.index.setdefault(_key(tokens, i + NGRAM), []).append(start + i + NGRAM)
        self.entries += max(len(tokens) - NGRAM + 1, 0)

    def _drop_oldest(self) -> None:
        """Forget the oldest request; its index entries go when a lookup reads them, or all at once when they are
        as many as the held ones (a window no lookup asks for, the system prompt's, gains one every request)."""
        self.starts.popleft()
        end = self.starts[0] - 1 if self.starts else self.base + len(self.buf)  # the next request's SEP
        del self.buf[: end - self.base]
        self.base = end
        if self.entries > 2 * self.max_tokens:
            self.index, self.entries = {}, 0
            for start in self.starts:
                i = start - self.base
                while i < len(self.buf) and self.buf[i] != SEP:
                    i += 1
                self._index(self.buf[start - self.base : i], start)

    def lookup(self, context: list[int], options: SuffixOptions) -> Continuations:
        """The continuations of the context's last tokens in the pool (module docstring); counted in `stats`."""
        t0 = time.perf_counter()
        found = self._lookup(context, options) if len(context) >= NGRAM else NOTHING
        seconds = time.perf_counter() - t0
        with self.lock:
            self.lookups += 1
            self.hits += found.longest >= options.min_match
            self.lookup_s += seconds
            self.recent.append(seconds)
        return found

    def entries_at(self, context: list[int]) -> int:
        """The index's entries for the window `context` ends with (what `lookup` would start from; those of dropped
        requests included until a lookup removes them)."""
        return len(self.index.get(_key(context, len(context)), ())) if len(context) >= NGRAM else 0

    def _lookup(self, context: list[int], options: SuffixOptions) -> Continuations:
        with self.lock:
            found = self.index.get(_key(context, len(context)))
            if not found:
                return NOTHING
            live = next((k for k, p in enumerate(found) if p - NGRAM > self.base), len(found))
            if live:  # entries of dropped requests (positions only grow: they come first)
                del found[:live]
                self.entries -= live
            buf, base = self.buf, self.base
            matched = []  # (match length, position), the most recent first
            for p in reversed(found[-options.scan :]):
                m = NGRAM
                while m < options.max_match and m < len(context):
                    token = buf[p - m - 1 - base] if p - m - 1 >= base else SEP
                    if token == SEP or token != context[-m - 1]:
                        break
                    m += 1
                matched.append((m, p))
            matched.sort(key=lambda s: -s[0])  # stable: the most recent first among equals
            kept = []  # the longest matches that continue, each its continuation read only once it ranks
            for m, p in matched:
                span = min(options.max_spec, max(options.branch_len, int(options.spec_factor * m)))
                end = min(p - base + span, len(buf))
                follow = buf[p - base : end].tolist()
                if SEP in follow:
                    follow = follow[: follow.index(SEP)]
                if follow:
                    kept.append((m, follow))
                    if len(kept) == options.max_matches:
                        break
            factors = self.factors
        return _top_nodes([f for _, f in kept], options, kept[0][0] if kept else 0, factors)

    @property
    def calibration(self) -> float:
        """The pool's factor on its estimates, every depth together (not a hit rate: `hits` / `lookups` is one):
        nodes accepted over nodes estimated, of the trees drafted from it alone (`record`), starting from PRIOR
        nodes accepted as estimated."""
        return (PRIOR + sum(self.accepted)) / (PRIOR + sum(self.expected))

    def record(self, nodes: list[tuple[int, float, bool]]) -> None:
        """A tree drafted from the pool alone: each of its pool nodes' depth, estimate before the calibration, and
        whether it was accepted. Each depth's factor: its nodes accepted over estimated, starting from PRIOR nodes
        at the factor of every depth together (a depth seldom drafted takes the pool's; one often drafted, its own:
        estimates counted from matches that all agree overrate deep nodes most)."""
        with self.lock:
            for depth, raw, accepted in nodes:
                d = min(depth, DEPTHS) - 1
                self.expected[d] += raw
                self.accepted[d] += accepted
            overall = self.calibration
            self.factors = tuple(
                (PRIOR * overall + a) / (PRIOR + e) for a, e in zip(self.accepted, self.expected, strict=True)
            )

    def stats(self) -> dict[str, float]:
        """What /metrics shows: tokens and requests held, index entries, lookups, hits (a match of `min_match`
        tokens or more: its branches drafted), lookup seconds in all and their p95 over the last RECENT."""
        with self.lock:
            recent = sorted(self.recent)
            p95 = recent[min(int(0.95 * len(recent)), len(recent) - 1)] if recent else 0.0
            return {
                "tokens": len(self),
                "requests": len(self.starts),
                "index_entries": self.entries,
                "lookups": self.lookups,
                "hits": self.hits,
                "lookup_seconds": self.lookup_s,
                "lookup_seconds_p95": p95,
                "calibration": self.calibration,
            }


def _key(tokens, end: int) -> int:
    """The window of NGRAM tokens ending before `end`, as one int (token ids < 2**21)."""
    a, b, c = tokens[end - 3], tokens[end - 2], tokens[end - 1]
    return (a << 42) | (b << 21) | c


def _top_nodes(
    follows: list[list[int]], options: SuffixOptions, longest: int, factors: Sequence[float]
) -> Continuations:
    """The likeliest nodes of the continuations' trie (at most `pool_nodes`): each node's probability estimated as
    matches through it / (matches + 1) (one match is no certainty) times `factors` at its depth (the last for any
    deeper), at most 1 and at most its parent's; those under `min_prob` left out; likeliest first, parents first
    among equals (so a parent always comes before its children)."""
    if not follows:
        return NOTHING
    counts: dict[tuple[int, ...], int] = {}
    for follow in follows:
        for d in range(1, len(follow) + 1):
            key = tuple(follow[:d])
            counts[key] = counts.get(key, 0) + 1
    scale, prob = 1 / (len(follows) + 1), {}
    for path, count in counts.items():  # each follow's prefixes in order: a parent is valued before its children
        p = min(count * scale * factors[min(len(path), len(factors)) - 1], 1.0)
        prob[path] = min(p, prob[path[:-1]]) if len(path) > 1 else p
    top = sorted(prob, key=lambda path: (-prob[path], len(path)))[: options.pool_nodes]
    chosen = [path for path in top if prob[path] >= options.min_prob]
    return Continuations(chosen, [prob[p] for p in chosen], [counts[p] * scale for p in chosen], len(follows), longest)


class SuffixDrafter(LookupDrafter):
    """Prompt lookup in the request, then the pool's continuations (module docstring); the pool is shared by every
    fork (one per server), and every finished request's tokens enter it (`finish`). `pool_tokens` 0: no pool."""

    name = "suffix"

    def __init__(self, options: SuffixOptions | None = None, pool: SuffixPool | None = None) -> None:
        super().__init__(options or SuffixOptions())
        if pool is None and self.options.pool_tokens:
            pool = SuffixPool(self.options.pool_tokens)
        self.pool = pool

    def find_branches(self, context: list[int]) -> list[list[int]]:
        """The request's own lookup branches and the pool's, taken in turn (the graft's budget cuts the last ones:
        measured on the agent workload, the pool's first lost to lookup alone, 6.2 against 7.0 tokens a round, the
        request copying its own transcript; in turn 7.8), the pool's none when its longest match is shorter than
        `min_match` (3, a window: against 5, on the extraction workload 3.49 tokens a round against 3.33, and on
        Spec-Bench, which does not repeat, 0.99x eagle+lookup against 0.97x; docs/benchmarks.md)."""
        own, pooled = self._found(context)
        return own if pooled is None else _in_turn(own, pooled.branches)

    def graft_branches(self, context: list[int]) -> tuple[Continuations | None, list[list[int]], list[list[int]]]:
        """The pool's continuations (None: none), which a graft may draft alone with the request's own lookup
        branches (the second list), its inner drafter resting; and `find_branches`', to graft onto its tree."""
        own, pooled = self._found(context)
        if pooled is None:
            return None, own, own
        return pooled, own, _in_turn(own, pooled.branches)

    def alone_worth(self, context: list[int]) -> tuple[float, int]:
        """Nothing where the pool holds no window the context ends with; else, of L matches at most (the window's
        entries, at most `scan` and `max_matches` of them), each node is worth at most the largest of the pool's
        factors times L / (L + 1) (and 1: `_top_nodes`), at most `pool_nodes` of them (the request's own branches
        drafted with them are worth nothing more)."""
        held = self.pool.entries_at(context) if self.pool is not None else 0
        matches = min(held, self.options.scan, self.options.max_matches)
        if not matches:
            return 0.0, 0
        return min(max(self.pool.factors) * matches / (matches + 1), 1.0), self.options.pool_nodes

    def _found(self, context: list[int]) -> tuple[list[list[int]], Continuations | None]:
        """The request's own lookup branches, and the pool's continuations (None: no pool, or its longest match is
        shorter than `min_match`)."""
        own = super().find_branches(context)
        if self.pool is None:
            return own, None
        pooled = self.pool.lookup(context, self.options)
        return own, pooled if pooled.longest >= self.options.min_match else None

    def finish(self, context: list[int]) -> None:
        if self.pool is not None:
            self.pool.add(context)


def _in_turn(own: list[list[int]], pooled: list[list[int]]) -> list[list[int]]:
    """Own branch, pool's branch, own ... (the pool's that repeat an own one left out), the rest after."""
    fresh = [b for b in pooled if b not in own]
    mixed = [b for pair in zip(own, fresh, strict=False) for b in pair]
    return mixed + own[len(mixed) // 2 :] + fresh[len(mixed) // 2 :]


def pool_of(drafter) -> SuffixPool | None:
    """The suffix pool a drafter drafts from, through the wrappers around it (a graft's branches, a budget's or a
    gate's inner drafter); None if it has none."""
    while drafter is not None:
        if isinstance(drafter, SuffixDrafter):
            return drafter.pool
        drafter = getattr(drafter, "lookup", None) or getattr(drafter, "inner", None)
    return None
