"""Self-distillation on a serving engine: any OpenAI-compatible server (vLLM, SGLang, `headstart serve`) answers.

    headstart distill --engine http://127.0.0.1:8000 --out runs/distill/smollm2 --permissive-only --concurrency 64

The same shards, ids, filters and resumption as local distillation (`shards.Shards`). headstart renders the
chat template itself and sends the rendered prompt as token ids to `/v1/completions`, so the template is the
one training reads; the answer's token ids are kept where the server returns them (`return_token_ids`: vLLM,
headstart serve), else its text is tokenised (the text's own tokens, which can differ from the ids the model
chose). Before any row, the served model must give the target's own greedy tokens on a probe prompt.

Many requests are in flight (`concurrency`) and rows are written as they complete. A server that dies, times
out or answers 5xx is retried with exponential backoff; past `retries` the run stops with one line, keeping
every row written, and the same command resumes it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import httpx
from tqdm import tqdm

from headstart.runtime.prompts import Prompt
from headstart.runtime.tokens import cut_at_eos, eos_ids, prompt_ids
from headstart.train.shards import Shards, row_seed

PROBE = "Count from one to ten, separated by commas."
PROBE_TOKENS = 6


class EngineError(ValueError):
    """The server cannot be used (unreachable after retries, another model, a refusal): one line for the user."""


class EngineClient:
    """An OpenAI-compatible completions endpoint, with retries."""

    def __init__(
        self, url: str, retries: int = 5, backoff_s: float = 0.5, timeout_s: float = 600, api_key: str | None = None
    ) -> None:
        """`url`: the server's root or its OpenAI base URL (`http://host:port/v1`, as OpenAI clients take it);
        `api_key`: sent as `Authorization: Bearer` when given."""
        self.url, self.retries, self.backoff_s = url.rstrip("/").removesuffix("/v1"), retries, backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.client = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers)
        self.token_ids = True  # ask for `return_token_ids` until the server says it does not know it
        try:
            models = self._call("GET", "/v1/models").json()["data"]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"{self.url}/v1/models did not list a model ({e})") from None
        self.model = models[0]["id"]

    def _call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        """One request; transport errors, timeouts and 5xx are retried with backoff, then an EngineError."""
        for attempt in range(self.retries + 1):
            try:
                r = self.client.request(method, path, json=body)
                if r.status_code < 500:
                    return r
                why = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise EngineError(f"the server at {self.url} failed {self.retries + 1} times ({why})")

    def complete(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int | None) -> dict:
        """The first choice of one completion of `prompt_ids` (token ids, rendered by us)."""
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature}
        if seed is not None:
            body["seed"] = seed
        if self.token_ids:
            body["return_token_ids"] = True
        r = self._call("POST", "/v1/completions", body)
        if r.status_code == 400 and self.token_ids and "return_token_ids" in r.text:
            self.token_ids = False  # an engine without the extension: fall back to the text
            return self.complete(prompt_ids, max_tokens, temperature, seed)
        if r.status_code != 200:
            raise EngineError(f"the server at {self.url} refused a request: HTTP {r.status_code} {r.text[:300]}")
        return r.json()["choices"][0]


def response_ids(choice: dict, tokenizer, eos_ids) -> list[int]:
    """The answer's token ids: the server's where it returns them, else the text's; ending in EOS when it stopped."""
    ids = choice.get("token_ids")
    if ids is None:
        ids = tokenizer(choice["text"], add_special_tokens=False).input_ids
    ids = cut_at_eos(list(ids), eos_ids)
    if choice.get("finish_reason") == "stop" and (not ids or ids[-1] not in eos_ids):
        ids.append(min(eos_ids))  # stopped at EOS, which the server left out of its text
    return ids


def check_served_model(engine: EngineClient, model, tokenizer, eos_ids) -> None:
    """The served model must be the target: its greedy tokens on a probe prompt are the target's own."""
    import torch

    ids = prompt_ids(tokenizer, PROBE)
    inputs = torch.tensor([ids], device=model.device)
    with torch.inference_mode():  # an explicit mask: a prompt token equal to the pad id is still attended to
        out = model.generate(
            inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=PROBE_TOKENS
        )
    ours = cut_at_eos(out[0, len(ids) :].tolist(), eos_ids)
    theirs = response_ids(engine.complete(ids, PROBE_TOKENS, 0.0, None), tokenizer, eos_ids)
    if theirs != ours:
        raise EngineError(
            f"the server at {engine.url} serves '{engine.model}', not this target: greedy on a probe prompt it "
            f"wrote {tokenizer.decode(theirs)!r}, the target {tokenizer.decode(ours)!r}"
        )


def distill_on_engine(
    engine: EngineClient,
    tokenizer,
    eos_ids,
    prompts: list[Prompt],
    out: str,
    *,
    max_new_tokens: int,
    temperature: float,
    concurrency: int,
    seed: int,
    rows_per_shard: int = 1000,
) -> dict:
    """Answer every prompt not answered yet, `concurrency` at a time; returns throughput figures (the defaults
    are `distill_with_engine`'s)."""
    shards = Shards(out, rows_per_shard)
    todo = [p for p in prompts if p.id not in shards.done]
    lock = threading.Lock()
    new_tokens, t0 = 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc=f"distill ({engine.model})", unit="row", dynamic_ncols=True)

    def answer(prompt: Prompt) -> None:
        nonlocal new_tokens
        ids = prompt_ids(tokenizer, prompt.text)
        seed_of_row = None if temperature == 0 else row_seed(seed, prompt.id)  # the same seed whenever it runs
        choice = engine.complete(ids, max_new_tokens, temperature, seed_of_row)
        row = {
            "id": prompt.id,
            "category": prompt.category,
            "prompt_ids": ids,
            "response_ids": response_ids(choice, tokenizer, eos_ids),
        }
        with lock:
            shards.append([row])
            new_tokens += len(row["response_ids"])
            bar.update(1)
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")

    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(answer, p) for p in todo]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in done if f.exception() is not None), None)
        if failed is not None:
            for f in futures:
                f.cancel()
            bar.close()
            raise EngineError(
                f"{failed.exception()}; {len(shards.done)} rows are in {out}: run the same command again to resume"
            )
    bar.close()
    return shards.figures(len(todo), new_tokens, time.perf_counter() - t0)


def distill_with_engine(
    url: str,
    model,
    tokenizer,
    prompts: list[Prompt],
    out: str,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    concurrency: int = 16,
    seed: int = 0,
    retries: int = 5,
    check_model: bool = True,
    api_key: str | None = None,
) -> dict:
    """Connect to the server at `url`, check it serves `model` (the target, loaded here), distill `prompts`."""
    from headstart.train.sources import made_by, open_manifest, record_run

    eos = eos_ids(model, tokenizer)
    engine = EngineClient(url, retries=retries, api_key=api_key)
    made = {**made_by(model, tokenizer, max_new_tokens, temperature), "dtype": f"served: {engine.model}"}
    open_manifest(out, made)
    if check_model:
        check_served_model(engine, model, tokenizer, eos)
    stats = distill_on_engine(
        engine,
        tokenizer,
        eos,
        prompts,
        out,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        concurrency=concurrency,
        seed=seed,
    )
    if stats["new_rows"]:
        record_run(out, {"engine": engine.url, "new_rows": stats["new_rows"], "new_tokens": stats["new_tokens"]})
    return stats
