"""Load test of a running `headstart serve`: C concurrent streaming clients, latency and throughput.

    headstart loadtest --url http://127.0.0.1:8000 --clients 1,4,16

Each client sends `requests_per_client` chat requests one after another (streaming, temperature 0),
over prompts from a JSONL file. Per level: p50/p95 latency, p50/p95 time to first token, total
generated tokens/s over the level's wall time, the mean acceptance length the server reported, and from its
/metrics (a headstart server's) the share of sequence-rounds that speculated and the tree nodes per speculating
sequence-round: what the budget chose at that load; and the share of prompt tokens its prefix cache held (a
headstart or vLLM server's: levels re-send earlier levels' prompts, so a prefix cache finds some).
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def one_request(client: httpx.Client, model: str, prompt: str, max_tokens: int) -> dict:
    """Stream one chat completion; latency, time to first token, tokens and the server's speculative stats."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, tokens, extra, arrivals = None, 0, {}, []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "latency_s": time.perf_counter() - t0}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
                first = arrivals[0] - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            extra = chunk.get("headstart", extra)
    latency = time.perf_counter() - t0
    return {
        "status": 200,
        "latency_s": latency,
        "ttft_s": first if first is not None else latency,
        "tokens": tokens,
        "acceptance_length": extra.get("acceptance_length", 0.0),
        "arrivals": arrivals,  # perf_counter() of each text delta
    }


def steady_tokens_per_s(per_client: list[list[dict]]) -> float:
    """Aggregate tok/s while every client is busy: from the last client's first token to the first client's last
    token (ramp-up and the tail excluded); a request's tokens spread evenly over its deltas. 0 when the clients were
    never all busy at once."""
    times = [[t for r in rs for t in r.get("arrivals", [])] for rs in per_client]
    if not all(times):
        return 0.0
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    if end <= start:
        return 0.0
    tokens = sum(
        r["tokens"] / len(r["arrivals"]) * sum(start <= t <= end for t in r["arrivals"])
        for rs in per_client
        for r in rs
        if r.get("arrivals")
    )
    return tokens / (end - start)


def auth(api_key: str | None) -> dict[str, str] | None:
    """The header a server started with `--api-key` wants."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


COUNTERS = {  # /metrics samples summed over their labels: a headstart server's sequence-rounds and verified nodes,
    # and prompt tokens looked up in / found by the prefix cache (headstart's or vLLM's)
    "speculative": ('headstart_rounds_total{mode="speculative"}',),
    "plain": ('headstart_rounds_total{mode="plain"}',),
    "nodes": ("headstart:spec_decode_num_draft_tokens_total",),
    "cache_queries": ("headstart_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
    "cache_hits": ("headstart_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    "drafting_s": (  # a round's own drafting: planning and proposing, and the drafters' update after it
        'headstart_round_phase_seconds_total{phase="propose"}',
        'headstart_round_phase_seconds_total{phase="observe"}',
    ),
    "round_s": ("headstart_round_phase_seconds_total",),
    "treeless_drafting_s": (  # the same in the rounds where no sequence drafted a tree
        'headstart_treeless_round_phase_seconds_total{phase="propose"}',
        'headstart_treeless_round_phase_seconds_total{phase="observe"}',
    ),
    "treeless_round_s": ("headstart_treeless_round_phase_seconds_total",),
}


def server_counts(url: str) -> dict[str, float]:
    """COUNTERS from the server's /metrics (0 for those it does not have)."""
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return dict.fromkeys(COUNTERS, 0.0)
    sums = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        for name, keys in COUNTERS.items():
            if key in keys or key.split("{")[0] in keys:
                sums[name] += float(value)
    return sums


def run_level(
    url: str, model: str, prompts: list[str], clients: int, per_client: int, max_tokens: int, api_key: str | None = None
) -> dict:
    def client_job(c: int) -> list[dict]:
        # a connection a request: llama-server closes a kept-alive connection after a streamed answer, and the next
        # request on it fails ("Server disconnected without sending a response")
        fresh = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(base_url=url, timeout=None, headers=auth(api_key), limits=fresh) as client:
            return [
                one_request(client, model, prompts[(c * per_client + i) % len(prompts)], max_tokens)
                for i in range(per_client)
            ]

    before = server_counts(url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        per_client = list(pool.map(client_job, range(clients)))
    wall = time.perf_counter() - t0
    after = server_counts(url)
    spec, plain, nodes, queries, hits, drafting, rounds, treeless, treeless_rounds = (
        after[k] - before[k] for k in COUNTERS
    )
    results = [r for rs in per_client for r in rs]
    ok = [r for r in results if r["status"] == 200]
    lat, ttft = [r["latency_s"] for r in ok], [r["ttft_s"] for r in ok]
    rate = [r["tokens"] / r["latency_s"] for r in ok]
    return {
        "clients": clients,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "p50_latency_s": percentile(lat, 0.5),
        "p95_latency_s": percentile(lat, 0.95),
        "p50_ttft_s": percentile(ttft, 0.5),
        "p95_ttft_s": percentile(ttft, 0.95),
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "steady_tokens_per_s": steady_tokens_per_s(per_client),
        "p50_request_tokens_per_s": percentile(rate, 0.5),
        "p95_request_tokens_per_s": percentile(rate, 0.95),
        "wall_s": wall,
        "acceptance_length": statistics.fmean(r["acceptance_length"] for r in ok) if ok else 0.0,
        "speculated_share": spec / (spec + plain) if spec + plain else 0.0,
        "nodes_per_speculating": nodes / spec if spec else 0.0,
        "prefix_cache_hit_share": hits / queries if queries else 0.0,
        "drafting_share": drafting / rounds if rounds else 0.0,
        "treeless_share": treeless_rounds / rounds if rounds else 0.0,
        "treeless_drafting_share": treeless / treeless_rounds if treeless_rounds else 0.0,
    }


COLUMNS = [
    ("clients", "clients", "{}"),
    ("requests", "requests", "{}"),
    ("failed", "failed", "{}"),
    ("p50_latency_s", "p50 latency s", "{:.2f}"),
    ("p95_latency_s", "p95 latency s", "{:.2f}"),
    ("p50_ttft_s", "p50 TTFT s", "{:.2f}"),
    ("p95_ttft_s", "p95 TTFT s", "{:.2f}"),
    ("tokens_per_s", "tok/s", "{:.1f}"),
    ("steady_tokens_per_s", "steady tok/s", "{:.1f}"),
    ("p50_request_tokens_per_s", "p50 tok/s per request", "{:.1f}"),
    ("p95_request_tokens_per_s", "p95 tok/s per request", "{:.1f}"),
    ("acceptance_length", "tau", "{:.2f}"),
    ("speculated_share", "speculated", "{:.0%}"),
    ("nodes_per_speculating", "nodes", "{:.1f}"),
    ("prefix_cache_hit_share", "prompt cached", "{:.0%}"),
    ("drafting_share", "drafting", "{:.1%}"),
    ("treeless_share", "treeless rounds", "{:.0%}"),
    ("treeless_drafting_share", "their drafting", "{:.1%}"),
]


def markdown(rows: list[dict], drafter: str) -> str:
    """One table row per concurrency level, the drafter in the first column."""
    lines = ["| drafter | " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for r in rows:
        lines.append(f"| {drafter} | " + " | ".join(fmt.format(r[key]) for key, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


# What a soak client sends, with the status it must get (200 for the valid kinds).
SOAK_KINDS = (
    "chat",
    "stream",
    "completion",
    "malformed_json",
    "wrong_type",
    "unknown_param",
    "bad_model",
    "disconnect",
    "oversized",
)


def soak_request(client: httpx.Client, kind: str, model: str, prompt: str, rng, answers: list | None = None) -> int:
    """One request of `kind`; its HTTP status (499 for a client that left on purpose). With `answers`, a valid
    greedy chat request asks for its token ids (vLLM's `return_token_ids`) and appends {prompt, token_ids}."""
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": rng.randint(8, 48),
        "temperature": rng.choice([0, 0.7, 1.0]),
    }
    if kind == "chat" and answers is not None and chat["temperature"] == 0:
        r = client.post("/v1/chat/completions", json={**chat, "return_token_ids": True})
        if r.status_code == 200:
            answers.append({"prompt": prompt, "token_ids": r.json()["choices"][0]["token_ids"]})
        return r.status_code
    if kind == "stream":
        with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            for _ in r.iter_lines():
                pass
            return r.status_code
    if kind == "disconnect":  # a long request whose client gives up after a moment
        try:
            client.post("/v1/chat/completions", json={**chat, "max_tokens": 400}, timeout=rng.uniform(0.2, 1.5))
        except httpx.TimeoutException:
            return 499
        return 200
    bodies = {
        "chat": ("/v1/chat/completions", json.dumps(chat)),
        "completion": ("/v1/completions", json.dumps({"model": model, "prompt": prompt, "max_tokens": 16})),
        "malformed_json": ("/v1/chat/completions", '{"model": "' + model + '", "messages": [}'),
        "wrong_type": ("/v1/chat/completions", json.dumps({**chat, "max_tokens": "16"})),
        "unknown_param": ("/v1/chat/completions", json.dumps({**chat, "frobnicate": 1})),
        "bad_model": ("/v1/chat/completions", json.dumps({**chat, "model": "x" * 10_000})),
        "oversized": ("/v1/completions", json.dumps({"model": model, "prompt": "y" * (6 << 20)})),
    }
    path, body = bodies[kind]
    return client.post(path, content=body, headers={"content-type": "application/json"}).status_code


def soak(
    url: str,
    model: str,
    prompts: list[str],
    seconds: float,
    clients: int,
    seed: int = 0,
    api_key: str | None = None,
    answers: list | None = None,
) -> dict:
    """`clients` threads send a random mix of SOAK_KINDS for `seconds` while /health is polled; counts by kind and
    status, /health latency, the server's resident memory (from /metrics) at the start and at the end, once the
    server is idle again. With
    `answers` (a list), the greedy chat answers are collected there (`soak_request`)."""
    import random
    import threading
    from collections import Counter

    def rss(after_idle: bool = False) -> float:
        """The server's resident MB; `after_idle`: once it runs and queues nothing (up to 60 s; a left client's
        job stops within a round), as at the start."""
        for _ in range(600 if after_idle else 0):
            health = httpx.get(url + "/health", timeout=30).json()
            if not health.get("running") and not health.get("queue_depth"):
                break
            time.sleep(0.1)
        for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("process_resident_memory_bytes "):
                return float(line.split()[1]) / 2**20
        return float("nan")

    counts: Counter = Counter()
    health: list[float] = []
    stop = time.perf_counter() + seconds
    rss_start = rss()

    def client_loop(c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        with httpx.Client(base_url=url, timeout=120, headers=auth(api_key)) as client:
            while time.perf_counter() < stop:
                kind = rng.choice(SOAK_KINDS)
                try:
                    status = soak_request(client, kind, model, rng.choice(prompts), rng, answers)
                except httpx.HTTPError as e:
                    status = f"client error {type(e).__name__}"
                counts[(kind, status)] += 1

    def health_loop() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                client.get("/health")
                health.append(time.perf_counter() - t0)
                time.sleep(0.2)

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    threads.append(threading.Thread(target=health_loop))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rss_end = rss(after_idle=True)
    by_kind = {f"{kind} {status}": n for (kind, status), n in sorted(counts.items(), key=str)}
    served = sum(n for (_, s), n in counts.items() if s == 200)
    errors = sum(n for (_, s), n in counts.items() if isinstance(s, int) and s >= 500)
    latency = {"health_p50_ms": 1e3 * percentile(health, 0.5), "health_p99_ms": 1e3 * percentile(health, 0.99)}
    return {
        "seconds": seconds,
        "clients": clients,
        "requests": sum(counts.values()),
        "served_200": served,
        "status_5xx": errors,
        "by_kind_and_status": by_kind,
        **latency,
        "rss_start_mb": rss_start,
        "rss_end_mb": rss_end,
    }
