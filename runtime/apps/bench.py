"""`headstart bench`: speed of every decoding method on a prompt file, measured in one process.

Methods run interleaved prompt by prompt after a warm-up, so machine noise hits all alike:
  plain      our decode loop with no drafter (the baseline of every speedup)
  hf         `model.generate` (greedy or sampling)
  hf-lookup  `model.generate(prompt_lookup_num_tokens=10)`
  any drafter spec (`registry.parse_spec`): lookup, medusa, eagle, eagle+lookup, layerskip:N, model:PATH,
  medusa:B (tree budget) ... — one run can compare several variants of one drafter.
  METHOD@LABEL   METHOD with the heads given as LABEL=DIR (`label_methods`): heads compared side by side,
  the shipped ones (label `shipped`) beside them.
  Heads trained with a LoRA on the target (medusa2) run on base + that adapter, loaded beside the
  base: their speed compares with plain decoding of the base (merged, the same cost per token), and
  their tokens are not compared with plain's (another model, see `headstart drift`).
This module measures (records, the summary table); `bench_report.py` writes them: every per-prompt record as JSON,
a Markdown table per category and overall, and a PNG chart of speedup and acceptance length per category and method.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from tqdm import tqdm

from headstart.runtime.adapters import adapter_sha
from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.registry import heads_adapter, option_names, parse_spec
from headstart.runtime.drafters.suffix import pool_of
from headstart.runtime.engine import Engine
from headstart.runtime.generate import GenerationStats, stream
from headstart.runtime.prefix_cache import PrefixCache
from headstart.runtime.prompts import load_prompts
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.sizing.policy import batch_of_one
from headstart.runtime.text import TextDecoder
from headstart.runtime.tokens import pad_id

HF_METHODS = ("hf", "hf-lookup")  # transformers' own generate, for reference
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_GROUPS = {c: "mt_bench" for c in MT_BENCH}  # Spec-Bench's six categories: MT-bench is one of them


@dataclass
class Record:
    method: str
    prompt_id: str
    category: str
    temperature: float
    new_tokens: int
    seconds: float
    target_passes: int | None  # None where the method does not report it (hf)
    draft_ms: float | None
    verify_ms: float | None
    same_as_plain: bool | None  # token ids equal to `plain`'s (greedy only)
    token_ids: list[int]
    accepted_per_depth: list[int] | None = None  # [d-1]: rounds whose accepted path reached depth d
    adapter: str | None = None  # the LoRA adapter of the target this method ran on, where not plain's
    phase_ms: dict[str, float] | None = None  # --breakdown: ms per round of each phase (`phase_breakdown`)


@dataclass
class Run:
    """One generation of one method; our loop's figures come from its `stats` (None for hf)."""

    tokens: list[int]
    seconds: float
    stats: GenerationStats | None = None
    chunks: list[list[int]] | None = None  # the tokens of each round

    @property
    def target_passes(self) -> int | None:
        return self.stats.target_passes if self.stats else None

    @property
    def accepted_per_depth(self) -> list[int] | None:
        return self.stats.accepted_per_depth if self.stats else None

    @property
    def draft_ms(self) -> float | None:
        return 1e3 * self.stats.draft_s / max(self.stats.target_passes, 1) if self.stats else None

    @property
    def verify_ms(self) -> float | None:
        return 1e3 * self.stats.verify_s / max(self.stats.target_passes, 1) if self.stats else None


def _run_ours(
    engine: Engine,
    drafter: Drafter,
    ids: list[int],
    sampling: SamplingParams,
    max_new: int,
    seed: int,
    prefix_cache: PrefixCache | None = None,
    planner=None,
):
    """The decode loop itself (no detokenising: that is not what the methods differ in)."""
    stats = GenerationStats()
    t0 = time.perf_counter()
    decoded = stream(engine.target, ids, drafter, sampling, max_new, engine.eos_ids, seed, stats, prefix_cache, planner)
    chunks = [c.tokens for c in decoded]
    return Run([t for chunk in chunks for t in chunk], time.perf_counter() - t0, stats, chunks)


def phase_breakdown(stats: GenerationStats, seconds: float, detokenise_s: float) -> dict[str, float]:
    """ms per round of each phase of `stats` (`generate.PHASES`), the detokenising a server would add, and the
    rest of the loop's wall time (`python`: the loop's own bookkeeping), the prefill left out."""
    rounds = max(stats.target_passes, 1)
    phases = {name: 1e3 * s / rounds for name, s in stats.phase_s.items()}
    rest = seconds - stats.prefill_s - sum(stats.phase_s.values())
    return {**phases, "python": 1e3 * max(rest, 0.0) / rounds, "detokenise": 1e3 * detokenise_s / rounds}


def _detokenise_s(engine: Engine, chunks: list[list[int]]) -> float:
    """Seconds to turn the rounds' tokens into streamed text, as `Engine.stream_text` does round by round."""
    decoder = TextDecoder(engine.tokenizer)
    t0 = time.perf_counter()
    for chunk in chunks:
        decoder.push(chunk)
    decoder.finish()
    return time.perf_counter() - t0


def _run_hf(engine: Engine, lookup: bool, ids: list[int], sampling: SamplingParams, max_new: int, seed: int):
    model = engine.target.model
    kwargs: dict = {"max_new_tokens": max_new, "pad_token_id": pad_id(engine.tokenizer, engine.eos_ids)}
    if engine.eos_ids:  # stop where our loop stops (`runtime/tokens.eos_ids`)
        kwargs["eos_token_id"] = sorted(engine.eos_ids)
    if sampling.greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        torch.manual_seed(seed)
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = 10
    inputs = torch.tensor([ids], device=engine.target.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
    return Run(out[0, len(ids) :].tolist(), time.perf_counter() - t0)


LABEL_SEP = "@"
SHIPPED_LABEL = "shipped"


def method_spec(method: str) -> str:
    """The drafter spec a bench method runs: `eagle3+lookup@mine` runs `eagle3+lookup` (with the heads `mine`)."""
    return "none" if method == "plain" else method.partition(LABEL_SEP)[0]


def label_methods(methods: list[str], labelled: dict[str, str], model_name: str | None) -> list[str]:
    """With heads given as {label: directory}: each method whose drafter is the one their kind names
    (heads/kinds.py) becomes METHOD@LABEL for each such label, and METHOD@shipped first where
    heads of that kind are shipped for `model_name` (unless a label says `shipped` itself)."""
    from headstart.heads.kinds import get_kind
    from headstart.heads.published import heads_kind
    from headstart.runtime.drafters.registry import heads_dir

    drafters = {label: get_kind(heads_kind(directory)).drafter_name for label, directory in labelled.items()}
    out = []
    for m in methods:
        base = parse_spec(method_spec(m)).base if m not in HF_METHODS else None
        labels = [label for label, drafter in drafters.items() if drafter == base]
        if not labels:
            out.append(m)
            continue
        shipped = SHIPPED_LABEL not in labels and heads_dir(base, None, model_name) is not None
        out += [f"{m}{LABEL_SEP}{label}" for label in ([SHIPPED_LABEL] if shipped else []) + labels]
    return out


def method_options(methods: list[str], options: dict) -> dict[str, dict]:
    """Each drafter method's share of `options` (None values dropped): an option goes to every method that
    takes it; `heads` is a {kind: directory} map, `labelled_heads` a {label: directory} map for METHOD@LABEL.
    An option no method takes is an error naming it."""
    given = {k: v for k, v in options.items() if v is not None}
    heads = given.pop("heads", {}) or {}
    labelled = given.pop("labelled_heads", {}) or {}
    specs = {m: parse_spec(method_spec(m)) for m in methods if m not in HF_METHODS}
    taken = {m: {k: v for k, v in given.items() if k in option_names(spec)} for m, spec in specs.items()}
    for m, spec in specs.items():
        label = m.partition(LABEL_SEP)[2]
        if label and label != SHIPPED_LABEL and label not in labelled:
            raise ValueError(f"method {m}: no heads are labelled {label} (`labelled_heads`)")
        if label in labelled:
            taken[m]["heads"] = labelled[label]
        elif heads.get(spec.base):
            taken[m]["heads"] = heads[spec.base]
    unused = [k for k in given if not any(k in t for t in taken.values())]
    if unused:
        raise ValueError(f"no method of {', '.join(methods)} takes {', '.join(unused)}")
    return taken


def run_method(
    engine: Engine,
    method: str,
    drafters: dict[str, Drafter],
    ids: list[int],
    sampling,
    max_new,
    seed,
    caches: dict[str, PrefixCache] | None = None,
    planners: dict | None = None,
) -> Run:
    """One generation of `method`; `caches`: each of our methods' prefix cache (none: no prefix cache); `planners`:
    each of our methods' planner under the `budget` speculation policy (none: each drafter sizes its own tree)."""
    if method in HF_METHODS:
        return _run_hf(engine, method == "hf-lookup", ids, sampling, max_new, seed)
    cache, planner = (caches or {}).get(method), (planners or {}).get(method)
    return _run_ours(engine, drafters[method], ids, sampling, max_new, seed, cache, planner)


def run_bench(
    engine: Engine,
    prompts_file: str,
    methods: list[str],
    temperatures: list[float],
    max_new_tokens: int = 128,
    limit_per_category: int | None = None,
    categories: set[str] | None = None,
    seed: int = 0,
    breakdown: bool = False,
    prefix_cache_gb: float = 0.0,
    speculation: str | None = None,
    **draft_options: str | int | dict | None,
) -> list[Record]:
    """Every method on every prompt and temperature; `breakdown`: each record also holds its round's cost per
    phase (`phase_breakdown`; the lm_head timed by hooks, which cost every method alike); `prefix_cache_gb` > 0:
    each of our methods keeps a prefix cache of that size across the prompts, as a server does (empty after the
    warm-up), so that a workload whose prompts start alike is replayed as a server would serve it. `speculation`: the
    policy each drafter method runs under (runtime/sizing/policy.py, a batch of one): `budget`, the server's load
    planner (None: the default, as the server's); `fixed`, each drafter's own tree sized by measured cost; `off`,
    plain.

    `draft_options` go to every drafter method that takes them (`method_options`): `heads` maps medusa/eagle to
    checkpoint directories (missing ones: the heads shipped for the engine's model), draft_layers, draft_model,
    depth, top_k, draft_vocab ...
    """
    options = method_options(methods, draft_options)  # every name checked before any loading
    engines = method_engines(engine, options)
    drafters = {m: engines[m].make_drafter(method_spec(m), **o) for m, o in options.items()}
    planners = {}
    for m, d in drafters.items():
        planners[m], drafters[m] = batch_of_one(speculation, engines[m].target, d)
    prompts = load_prompts(prompts_file, categories, limit_per_category, groups=SPEC_BENCH_GROUPS)
    encoded = [engine.encode(p.text) for p in prompts]
    for method in methods:  # warm-up: first calls pay for allocations and kernel selection
        run_method(
            engines.get(method, engine), method, drafters, encoded[0], SamplingParams(), 16, seed, None, planners
        )
    for drafter in drafters.values():  # what the warm-up wrote leaves the suffix pools: each starts empty
        if (pool := pool_of(drafter)) is not None:
            pool.clear()
    size = int(prefix_cache_gb * 2**30)
    caches = {m: PrefixCache(size, d.feature_layers) for m, d in drafters.items()} if size else {}
    records: list[Record] = []
    jobs = [(t, i) for t in temperatures for i in range(len(prompts))]
    with ExitStack() as timing:
        if breakdown:
            for e in {id(e): e for e in [engine, *engines.values()]}.values():
                timing.enter_context(e.target.timing_lm_head())
        for temperature, i in tqdm(jobs, desc="bench", unit="prompt", dynamic_ncols=True):
            records += _bench_prompt(
                engine,
                engines,
                methods,
                drafters,
                prompts[i],
                encoded[i],
                SamplingParams(temperature),
                max_new_tokens,
                seed,
                breakdown,
                caches,
                planners,
            )
    return records


def _bench_prompt(
    engine, engines, methods, drafters, prompt, ids, sampling, max_new_tokens, seed, breakdown, caches, planners
):
    """One prompt through every method: their records."""
    records, plain_tokens = [], None
    for method in methods:
        runs_on = engines.get(method, engine)
        run = run_method(runs_on, method, drafters, ids, sampling, max_new_tokens, seed, caches, planners)
        if method == "plain":
            plain_tokens = run.tokens
        same = run.tokens == plain_tokens if sampling.greedy and plain_tokens is not None else None
        adapter = None if runs_on is engine else runs_on.adapter
        phases = None
        if breakdown and run.stats is not None:
            phases = phase_breakdown(run.stats, run.seconds, _detokenise_s(runs_on, run.chunks))
        records.append(
            Record(
                method,
                prompt.id,
                prompt.category,
                sampling.temperature,
                len(run.tokens),
                run.seconds,
                run.target_passes,
                run.draft_ms,
                run.verify_ms,
                same if adapter is None else None,
                run.tokens,
                run.accepted_per_depth,
                adapter,
                phases,
            )
        )
    return records


def method_engines(engine: Engine, options: dict[str, dict]) -> dict[str, Engine]:
    """The engine each drafter method runs on: `engine`, or for heads trained with their own LoRA adapter
    (Medusa-2) the same model + that adapter, loaded once per adapter."""
    engines, loaded = {}, {}
    for method, o in options.items():
        adapter = heads_adapter(method_spec(method), engine.model_name, o.get("heads"))
        if adapter is None or adapter_sha(adapter) == engine.adapter_sha:
            engines[method] = engine
            continue
        if adapter not in loaded:
            dtype = str(engine.target.dtype).removeprefix("torch.")
            loaded[adapter] = Engine.load(
                engine.model_name, dtype, "none", str(engine.target.device), engine.profile, adapter
            )
        engines[method] = loaded[adapter]
    return engines


def summarize(records: list[Record]) -> dict:
    """{(temperature, category or 'overall'): {method: figures}}; tokens/s is total tokens over total time."""
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.temperature, r.category, r.method)].append(r)
        groups[(r.temperature, "overall", r.method)].append(r)
    table: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for (temperature, category, method), rs in groups.items():
        tokens = sum(r.new_tokens for r in rs)
        seconds = sum(r.seconds for r in rs)
        passes = [r.target_passes for r in rs if r.target_passes is not None]
        same = [r.same_as_plain for r in rs if r.same_as_plain is not None]
        table[(temperature, category)][method] = {
            "prompts": len(rs),
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "acceptance_length": tokens / sum(passes) if passes and sum(passes) else None,
            "draft_ms": _mean([r.draft_ms for r in rs]),
            "verify_ms": _mean([r.verify_ms for r in rs]),
            "same_as_plain": f"{sum(same)}/{len(same)}" if same else None,
            "acceptance_per_depth": _acceptance_per_depth(rs),
        }
    for row in table.values():
        for figures in row.values():
            for base in ("plain", "hf"):
                ref = row.get(base, {}).get("tokens_per_s")
                figures[f"speedup_vs_{base}"] = figures["tokens_per_s"] / ref if ref else None
    return table


def _acceptance_per_depth(records: list[Record]) -> list[float] | None:
    """[d-1]: the share of rounds whose path reached depth d among those that reached depth d-1 (the
    training metric `head_{d}/acceptance`, measured while decoding); None where the method does not report it."""
    counts = [r.accepted_per_depth for r in records if r.accepted_per_depth is not None]
    if not counts:
        return None
    reached = [sum(r.target_passes or 0 for r in records)]  # every round reaches depth 0
    for d in range(max(map(len, counts), default=0)):
        reached.append(sum(c[d] for c in counts if len(c) > d))
    return [reached[d + 1] / reached[d] if reached[d] else 0.0 for d in range(len(reached) - 1)]


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None
