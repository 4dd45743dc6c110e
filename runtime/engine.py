"""Engine: the Python API over the decode loop — text in, tokens and text out, stop strings handled.

engine = Engine.load("smollm2-135m-instruct", dtype="bfloat16", drafter="lookup")
result = engine.generate("Summarize: ...", max_new_tokens=128)
result.text, result.stats.acceptance_length
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from runtime.drafters import Drafter, make_drafter
from runtime.generate import Chunk, GenerationStats, stream
from runtime.models import DEFAULT_MODEL, load_model
from runtime.sampling import SamplingParams
from runtime.target import Target


@dataclass
class Result:
    token_ids: list[int]
    text: str
    stats: GenerationStats


class Engine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, drafter: Drafter | None = None):
        self.target = Target(model)
        self.tokenizer = tokenizer
        self.drafter = drafter or Drafter()
        eos = model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)

    @classmethod
    def load(
        cls,
        model: str = DEFAULT_MODEL,
        dtype: str = "float32",
        drafter: str = "none",
        device: str = "cpu",
        heads: str | None = None,
        **options: int | str | None,
    ) -> Engine:
        """`options` for the drafter (None = its default): tree_budget, tree_depth, tree_top_k, draft_vocab,
        draft_model, draft_layers (see `make_drafter`).

        medusa and eagle load `heads`, or else the heads shipped for `model` (heads/trained/).
        """
        hf_model, tokenizer = load_model(model, dtype=dtype, device=device)
        return cls(hf_model, tokenizer, make_drafter(drafter, hf_model, tokenizer, heads, model_name=model, **options))

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of `prompt`, as one user turn under the model's chat template unless `chat` is False."""
        if not prompt.strip():
            raise ValueError("empty prompt")
        if not chat:
            return self.tokenizer(prompt).input_ids
        if not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template; pass the prompt raw (--raw)")
        return self.encode_chat([{"role": "user", "content": prompt}])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation under the model's chat template, ready for the assistant's turn."""
        return list(
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        )

    def stream(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 128,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stats: GenerationStats | None = None,
    ) -> Iterator[Chunk]:
        """The decode loop's chunks, ending early once the generated text contains a stop string."""
        generated: list[int] = []
        for chunk in stream(self.target, prompt_ids, self.drafter, sampling, max_new_tokens, self.eos_ids, seed, stats):
            if stop and _find_stop(self.tokenizer.decode(generated + chunk.tokens), stop) is not None:
                for k in range(1, len(chunk.tokens) + 1):  # the first token that completes a stop string
                    if _find_stop(self.tokenizer.decode(generated + chunk.tokens[:k]), stop) is not None:
                        yield Chunk(chunk.tokens[:k], min(chunk.drafted, k))
                        return
            generated += chunk.tokens
            yield chunk

    def stream_text(self, prompt_ids: list[int], stop: Sequence[str] = (), **kwargs) -> Iterator[str]:
        """Text deltas as tokens are accepted; the text ends before a stop string, which is never shown."""
        decoder = TextDecoder(self.tokenizer, stop)
        for chunk in self.stream(prompt_ids, stop=stop, **kwargs):
            if delta := decoder.push(chunk.tokens):
                yield delta
        if delta := decoder.finish():
            yield delta

    def generate(self, prompt: str | list[int], chat: bool = True, **kwargs) -> Result:
        """Generate for a text prompt (or token ids); kwargs as for `stream`. The text ends before a stop string."""
        prompt_ids = self.encode(prompt, chat) if isinstance(prompt, str) else prompt
        stats = kwargs.pop("stats", None) or GenerationStats()
        token_ids = [t for chunk in self.stream(prompt_ids, stats=stats, **kwargs) for t in chunk.tokens]
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cut = _find_stop(text, kwargs.get("stop", ()))
        return Result(token_ids, text[:cut] if cut is not None else text, stats)


class TextDecoder:
    """Incremental detokenisation: `push(tokens)` returns the text that is safe to show so far.

    Text is held back while a stop string may still be forming or a UTF-8 sequence is incomplete;
    the text ends before the first stop string. `finish()` returns what is left.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text, self.emitted = "", 0
        self.stopped = False  # a stop string was found

    def push(self, tokens: list[int]) -> str:
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = _find_stop(text, self.stop)
        self.stopped = cut is not None
        self.text = text if cut is None else text[:cut]
        safe = len(self.text) if self.stopped else len(self.text) - self.hold
        while safe > self.emitted and self.text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence
            safe -= 1
        return self._emit(safe)

    def finish(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted : upto], upto
        return delta


def _find_stop(text: str, stop: Sequence[str]) -> int | None:
    """Index of the earliest stop string in `text`, or None."""
    hits = [i for s in stop if s and (i := text.find(s)) >= 0]
    return min(hits) if hits else None
