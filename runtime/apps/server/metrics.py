"""Prometheus metrics of the server, in their own registry (several servers may live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from headstart.runtime.drafters.suffix import SuffixPool
from headstart.runtime.generate import GenerationStats
from headstart.runtime.prefix_cache import PrefixCache

# The label of every path the server routes; any other path (a scanner's, a typo) counts as "other", so the
# label set, and /metrics with it, stays bounded whatever clients send.
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


def path_label(path: str) -> str:
    return path if path in ROUTES else "other"


# The suffix pool's figures on /metrics (`SuffixPool.stats` keys), as headstart_suffix_pool_KEY: gauges, counters.
POOL_GAUGES = (
    ("tokens", "tokens of finished requests held"),
    ("requests", "finished requests held"),
    ("index_entries", "n-gram windows indexed"),
    ("lookup_seconds_p95", "p95 of the last 1024 lookups' seconds"),
    ("calibration", "factor on the pool's estimates: nodes accepted over those expected, of its trees drafted alone"),
)
POOL_COUNTERS = (
    ("lookups", "lookups"),
    ("hits", "lookups whose match was long enough to draft from"),
    ("lookup_seconds", "seconds of every lookup"),
)


class PoolCollector:
    """The suffix pool's figures, read when /metrics is scraped."""

    def __init__(self, pool: SuffixPool) -> None:
        self.pool = pool

    def collect(self):
        stats = self.pool.stats()
        for key, text in POOL_GAUGES:
            yield GaugeMetricFamily(f"headstart_suffix_pool_{key}", text, value=stats[key])
        for key, text in POOL_COUNTERS:
            yield CounterMetricFamily(f"headstart_suffix_pool_{key}", text, value=stats[key])


class PrefixCacheCollector:
    """The prefix cache's figures, read when /metrics is scraped; its queries and hits count prompt tokens, as
    vLLM's prefix_cache_queries / prefix_cache_hits do."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def collect(self):
        stats = self.cache.stats()
        yield GaugeMetricFamily("headstart_prefix_cache_blocks", "blocks held", value=stats["blocks"])
        yield GaugeMetricFamily("headstart_prefix_cache_bytes", "bytes held", value=stats["bytes"])
        yield CounterMetricFamily(
            "headstart_prefix_cache_queries", "prompt tokens looked up", value=stats["looked_up_tokens"]
        )
        yield CounterMetricFamily("headstart_prefix_cache_hits", "prompt tokens found", value=stats["hit_tokens"])


class ServerMetrics:
    """`pool`: the drafter's suffix pool, shown as headstart_suffix_pool_* (None: the drafter has none);
    `prefix_cache`: shown as headstart_prefix_cache_* (None: none)."""

    def __init__(self, pool: SuffixPool | None = None, prefix_cache: PrefixCache | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends
        if pool is not None:
            r.register(PoolCollector(pool))
        if prefix_cache is not None:
            r.register(PrefixCacheCollector(prefix_cache))
        self.requests = Counter(
            "headstart_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.tokens = Counter("headstart_generated_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("headstart_prompt_tokens", "prompt tokens processed", registry=r)
        self.queue_depth = Gauge("headstart_queue_depth", "requests waiting for the model worker", registry=r)
        self.running = Gauge("headstart_running_requests", "requests being generated (0 or 1)", registry=r)
        self.ttft = Histogram(
            "headstart_time_to_first_token_seconds",
            "arrival to first generated token",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=r,
        )
        self.latency = Histogram(
            "headstart_request_latency_seconds",
            "arrival to last token",
            buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160),
            registry=r,
        )
        self.acceptance = Histogram(
            "headstart_acceptance_length",
            "tokens per target pass, one value per request",
            buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8),
            registry=r,
        )
        # speculation as vLLM counts it (vllm:spec_decode_*): a draft is a round with a tree, its draft tokens the
        # tree's nodes (all verified), position p the nodes accepted at tree depth p + 1
        self.drafts = Counter("headstart:spec_decode_num_drafts", "rounds that verified a tree", registry=r)
        self.draft_tokens = Counter("headstart:spec_decode_num_draft_tokens", "tree nodes verified", registry=r)
        self.accepted_tokens = Counter(
            "headstart:spec_decode_num_accepted_tokens", "tree nodes accepted (draft tokens kept)", registry=r
        )
        self.accepted = Counter(
            "headstart:spec_decode_num_accepted_tokens_per_pos",
            "tree nodes accepted at each position (position p: tree depth p + 1)",
            ["position"],
            registry=r,
        )
        self.rounds = Counter(
            "headstart_rounds", "target passes, speculative (with a tree) or plain", ["mode"], registry=r
        )
        self.phases = Counter(
            "headstart_round_phase_seconds",
            "seconds of the rounds' phases (generate.PHASES; a round's counted once for each request in it)",
            ["phase"],
            registry=r,
        )
        self.treeless_phases = Counter(
            "headstart_treeless_round_phase_seconds",
            "of those, the rounds in which no sequence drafted a tree (counted once for each request in them)",
            ["phase"],
            registry=r,
        )

    def record_generation(self, stats: GenerationStats) -> None:
        """One finished (or cancelled) generation's statistics."""
        self.tokens.inc(stats.new_tokens)
        if stats.target_passes:
            self.acceptance.observe(stats.acceptance_length)
        for position, n in enumerate(stats.accepted_per_depth):
            self.accepted.labels(position=str(position)).inc(n)
        self.drafts.inc(stats.spec_steps)
        self.draft_tokens.inc(stats.draft_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        self.rounds.labels(mode="speculative").inc(stats.spec_steps)
        self.rounds.labels(mode="plain").inc(stats.plain_passes)
        for phase, seconds in stats.phase_s.items():
            self.phases.labels(phase=phase).inc(seconds)
        for phase, seconds in stats.treeless_phase_s.items():
            self.treeless_phases.labels(phase=phase).inc(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
