"""Engine: the Python API over the decode loop — text in, tokens and text out, stop strings handled.

    engine = Engine.load("smollm2-135m-instruct", dtype="auto", drafter="eagle+lookup")
    result = engine.generate("Summarize: ...", max_new_tokens=128)
    result.text, result.stats.acceptance_length

The engine owns the target (model + KV cache) and a default drafter; any call may pass another
`drafter=` (one built by `make_drafter` for this engine's model). Nothing is swapped on the engine.
One request at a time: the target's cache belongs to the call that is streaming.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from headstart.heads.checkpoint import CheckpointConfig
from headstart.heads.kinds import KINDS
from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.registry import (
    entry,
    heads_adapter,
    heads_dir,
    make_drafter,
    option_names,
    parse_spec,
)
from headstart.runtime.drafters.together import measure_catch_up, measure_shared
from headstart.runtime.generate import Chunk, GenerationStats, SharedPrefix, stream
from headstart.runtime.models import DEFAULT_MODEL, load_model
from headstart.runtime.paths import cache_dir
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.sizing.cost_curve import LiveSizer, calibrated_target, cost_curve
from headstart.runtime.sizing.planner import Planner
from headstart.runtime.text import TextDecoder
from headstart.runtime.tokens import chat_ids, eos_ids
from headstart.runtime.tree import TreeChoice


@dataclass
class TextChunk:
    tokens: list[int]  # new tokens of one round (cut at the token that completes a stop string)
    drafted: int  # how many of them (the first ones) were draft tokens the target accepted
    text: str  # the text these tokens made safe to show (held back while a stop string may be forming)
    finish_reason: str | None = None  # on the last chunk: "stop" (EOS, stop string), "length" or "time"


class RequestText:
    """A request's rounds as text: incremental detokenising, cut at the token that completes a stop string."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str], eos: frozenset[int]) -> None:
        self.decoder, self.stop, self.eos_ids, self.eos = TextDecoder(tokenizer, stop), stop, eos, False

    def push(self, chunk: Chunk) -> TextChunk:
        """The chunk's text; finish_reason "stop" when a stop string completed (its text never shown)."""
        before = self.decoder.snapshot() if self.stop else self.decoder
        text = self.decoder.push(chunk.tokens)
        if self.decoder.stopped:  # cut at the first token that completes the stop string
            self.decoder, text = before, ""
            for k, token in enumerate(chunk.tokens, 1):
                text += self.decoder.push([token])
                if self.decoder.stopped:
                    return TextChunk(chunk.tokens[:k], min(chunk.drafted, k), text, "stop")
        self.eos = self.eos or bool(chunk.tokens and chunk.tokens[-1] in self.eos_ids)
        return TextChunk(chunk.tokens, chunk.drafted, text)

    def end(self, finish: str) -> TextChunk:
        """The last chunk: the text held back, and why the request ended ("stop" once EOS came, else `finish`)."""
        return TextChunk([], 0, self.decoder.finish(), "stop" if self.eos else finish)


@dataclass
class Result:
    token_ids: list[int]
    text: str
    stats: GenerationStats
    finish_reason: str


class Engine:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        drafter: Drafter | str | None = None,
        model_name: str | None = None,
        profile: str | None = None,
        adapter: str | None = None,
        prepack: bool | None = None,
        **options: Any,
    ) -> None:
        """`drafter`: the default drafter, or its spec (built here by `make_drafter` with `options`, sized for this
        target); `model_name`: what the model was loaded by (its shipped heads and profile go by it); `profile`:
        the drafter profile of `make_drafter` (None: the model's own, `profiles.default_profile`); `adapter`: the
        LoRA adapter directory applied to the model, if any; `prepack`: the target's prepacked kernels
        (`runtime/kernels.py`; None: on)."""
        self.target = calibrated_target(model, fast=prepack)  # float32 on a CPU: MKL's or oneDNN's, as measured here
        self.tokenizer = tokenizer
        self.model_name, self.profile, self.adapter = model_name, profile, adapter
        self._sizers: dict[tuple[str, str], LiveSizer] = {}  # (drafter spec, heads) -> its live tree size
        self.eos_ids = eos_ids(model, tokenizer)
        self.drafter = self.make_drafter(drafter, **options) if isinstance(drafter, str) else drafter or Drafter()

    @classmethod
    def load(
        cls,
        model: str = DEFAULT_MODEL,
        dtype: str = "float32",
        drafter: str = "none",
        device: str = "cpu",
        profile: str | None = None,
        adapter: str | None = None,
        merge_adapter: bool = True,
        prepack: bool | None = None,
        **options: Any,
    ) -> Engine:
        """Load `model` and build its default `drafter` (a spec such as `eagle+lookup`, `medusa:16`).

        `options` go to the drafter (`heads=DIR`, `budget=`, `depth=` ...: `registry.option_names`);
        `profile` None picks the model's own (`profiles.default_profile`); `adapter` is a peft LoRA
        adapter directory applied on top (`runtime/adapters.py`), merged unless `merge_adapter` is False;
        None: the adapter the drafter's heads were trained with, if any (Medusa-2 heads hold theirs).
        """
        if adapter is None:  # the target changes: base + the adapter (`Engine.adapter` says so; the CLI prints it)
            adapter = heads_adapter(drafter, model, options.get("heads"))
        hf_model, tokenizer = load_model(model, dtype, device, adapter, merge_adapter)
        return cls(
            hf_model, tokenizer, drafter, model_name=model, profile=profile, adapter=adapter, prepack=prepack, **options
        )

    @property
    def adapter_sha(self) -> str | None:
        """The hash of the LoRA adapter the model carries (`runtime/adapters.py`), None for a plain model."""
        return getattr(self.target.model.config, "headstart_adapter", None)

    def make_drafter(self, spec: str, **options: Any) -> Drafter:
        """A new drafter for this engine's model and profile (`registry.make_drafter`). Trained heads with
        measured per-rank accuracies get the tree budget this device makes best (`tree_choice`) unless a budget
        or a profile is given; EAGLE drafters then keep it the best for the acceptance they see (the sizer
        is shared by every drafter of the spec made here: `eagle` and `eagle+suffix` have one each)."""
        sizer = self._sizer(spec, **options)
        given = options
        if sizer is not None:
            greedy, sampled = sizer.choice[False], sizer.choice[True]
            sized = {"budget": greedy.budget, "sampled_budget": sampled.budget, "depth": greedy.depth}
            takes = option_names(spec)
            options = {**options, **{k: v for k, v in sized.items() if k in takes and options.get(k) is None}}
        drafter = make_drafter(
            spec, self.target.model, self.tokenizer, model_name=self.model_name, profile=self.profile, **options
        )
        heads = getattr(drafter, "inner", drafter)  # a graft's heads
        if sizer is not None and hasattr(heads, "resize") and all(given.get(k) is None for k in sized):
            heads.resize(sampled, sampled=True)  # the sampled shape as the sizer has it now
            heads.sizer = sizer
        return drafter

    def tree_choice(self, spec: str, **options: Any) -> TreeChoice | None:
        """The calibrated greedy tree of `spec` as it stands (`runtime/sizing/cost_curve.py`): None when a profile or a
        budget was given, when the drafter has no trained heads, or their config holds no per-rank accuracies."""
        sizer = self._sizer(spec, **options)
        return sizer.choice[False] if sizer is not None else None

    def _sizer(self, spec: str, **options: Any) -> LiveSizer | None:
        """The live tree size of `spec` (`tree_choice`), measured and chosen on first use."""
        parsed = parse_spec(spec)
        base = parsed.base
        sized = {kind.drafter_name for kind in KINDS.values() if kind.sized}  # drafters whose tree budget is sized here
        given = options.get("budget") is not None or (parsed.value is not None and entry(base).positional == "budget")
        if self.profile is not None or given or base not in sized:  # `eagle:6`: a budget given in the spec
            return None
        heads = heads_dir(base, options.get("heads"), self.model_name)
        config = CheckpointConfig.find(heads)
        accuracy = config.measured_accuracy if config is not None else None
        if not accuracy:
            return None
        key = (spec, str(heads))  # a graft's heads see other rounds than the bare heads' (a bench runs both)
        if key not in self._sizers:
            curve = cost_curve(self.target, cache_dir() / "costs")
            draft_ms, shared, pair_ms = self._draft_ms_per_depth(spec, **options)
            self._sizers[key] = LiveSizer(curve, accuracy, draft_ms, shared=shared, pair_ms=pair_ms)
        return self._sizers[key]

    def _draft_ms_per_depth(self, spec: str, **options: Any) -> tuple[float, float, float]:
        """ms of drafting per tree depth, measured: a short greedy decode of a synthetic prompt with `spec`'s
        drafter (its options and profile, the default tree size); the share of it that sequences drafting
        together pay once (`together.measure_shared`, 4 forks on the same prompt); and the ms a pair costs the
        head to catch up with (`together.measure_catch_up`). Heads of a static tree (Medusa's) guess every depth
        at once: 0, 0, 0."""
        base = parse_spec(spec).base
        if any(kind.static_tree and kind.drafter_name == base for kind in KINDS.values()):
            return 0.0, 0.0, 0.0
        sizes = ("budget", "sampled_budget", "depth")  # the rest (top_k, draft_vocab ...) as the real drafter's
        own = {k: v for k, v in options.items() if k in option_names(base) and k not in sizes}
        if "min_prob" in option_names(base):
            own["min_prob"] = 0.0  # every depth drafted, so the time divides by the depth
        drafter = make_drafter(
            base, self.target.model, self.tokenizer, model_name=self.model_name, profile=self.profile, **own
        )
        vocab, gen = self.target.model.config.vocab_size, torch.Generator().manual_seed(0)
        prompt = torch.randint(0, vocab, (64,), generator=gen).tolist()
        stats = GenerationStats()
        for _ in stream(self.target, prompt, drafter, max_new_tokens=32, stats=stats):
            pass
        rounds = max(stats.target_passes - stats.plain_passes, 1)
        per_depth = 1e3 * (stats.phase_s["propose"] + stats.phase_s["observe"]) / rounds / drafter.depth
        features = self.target.prefill(prompt[:-1], drafter.feature_layers) if drafter.feature_layers else None
        return per_depth, measure_shared(drafter, prompt, features), measure_catch_up(drafter, prompt, features)

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of `prompt`, as one user turn under the model's chat template unless `chat` is False."""
        if not prompt.strip():
            raise ValueError("empty prompt")
        if not chat:
            return self.tokenizer(prompt).input_ids
        return self.encode_chat([{"role": "user", "content": prompt}])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation under the model's chat template, ready for the assistant's turn
        (`runtime/tokens.chat_ids`: what the messages say stays text)."""
        return chat_ids(self.tokenizer, messages)

    def chat_prefix(self) -> SharedPrefix | None:
        """The tokens every chat prompt starts with under the model's template (its system turn), to be cached once
        (`generate.SharedPrefix`); None if there are none or no template. Found where renders of different one-word
        messages part: several, since two words can be one token to a tokenizer (unknown to a small vocabulary)."""
        if not self.tokenizer.chat_template:
            return None
        return SharedPrefix.common([self.encode_chat([{"role": "user", "content": t}]) for t in ("A", "Z", "the", "7")])

    def stream(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 128,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stats: GenerationStats | None = None,
        drafter: Drafter | None = None,
        deadline: float | None = None,
        planner: Planner | None = None,
    ) -> Iterator[TextChunk]:
        """The decode loop's rounds as TextChunks; the last one carries the finish reason.

        Ends at EOS, after `max_new_tokens`, at the token that completes a stop string (its text is never
        shown), or ("time") at the first round that ends past `deadline` (a `time.perf_counter()` value).
        `drafter` None: the engine's own; `planner`: sizes its trees round by round (runtime/sizing/policy.py's
        `batch_of_one`; None: the drafter's own trees).
        """
        text = RequestText(self.tokenizer, stop, self.eos_ids)
        rounds = stream(
            self.target,
            prompt_ids,
            drafter or self.drafter,
            sampling,
            max_new_tokens,
            self.eos_ids,
            seed,
            stats,
            planner=planner,
        )
        finish = "length"
        for chunk in rounds:
            out = text.push(chunk)
            yield out
            if out.finish_reason:
                return
            if deadline is not None and time.perf_counter() > deadline and not text.eos:
                finish = "time"
                break
        yield text.end(finish)

    def stream_text(self, prompt_ids: list[int], **kwargs: Any) -> Iterator[str]:
        """Text deltas as tokens are accepted; kwargs as for `stream`."""
        for chunk in self.stream(prompt_ids, **kwargs):
            if chunk.text:
                yield chunk.text

    def generate(self, prompt: str | list[int], chat: bool = True, **kwargs: Any) -> Result:
        """Generate for a text prompt (or token ids); kwargs as for `stream`."""
        prompt_ids = self.encode(prompt, chat) if isinstance(prompt, str) else prompt
        stats = kwargs.pop("stats", None) or GenerationStats()
        token_ids: list[int] = []
        texts: list[str] = []
        finish = "length"
        for chunk in self.stream(prompt_ids, stats=stats, **kwargs):
            token_ids += chunk.tokens
            texts.append(chunk.text)
            finish = chunk.finish_reason or finish
        return Result(token_ids, "".join(texts), stats, finish)
