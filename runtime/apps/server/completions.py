"""What the routes do with a request: check it, tokenise it off the event loop, queue it on the worker, and answer
it whole or as server-sent events; every answer, errors included, counted in the metrics."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from headstart.runtime.apps.server.metrics import ServerMetrics, path_label
from headstart.runtime.apps.server.schema import APIError, choice, clip, completion_id, now, usage
from headstart.runtime.apps.server.worker import Job, QueueFullError, Worker, WorkerDeadError
from headstart.runtime.drafters.suffix import pool_of
from headstart.runtime.engine import Engine
from headstart.runtime.prefix_cache import DEFAULT_GB, PrefixCache
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.tokens import chat_ids


@dataclass
class ServeConfig:
    model_name: str  # the id clients pass as `model` (a short name, never a path)
    max_queue: int = 64  # waiting requests; one more gets a 429
    time_limit_s: float = 300.0  # per request, from the start of its generation
    default_max_tokens: int = 512  # when a request gives none (capped by what the context has left)
    retry_after_s: int = 5  # the Retry-After of a 429
    step_aside_queue: int | None = None  # decode plainly while more requests than this wait; None = never
    min_acceptance: float | None = None  # decode plainly a while when recent rounds accept less; None = never
    max_body_bytes: int = 4 << 20  # a larger request body gets a 413 before it is parsed
    max_batch: int = 32  # requests decoded at once (continuous batching; chosen by measurement, docs/serving.md)
    kv_cache_gb: float = 4.0  # the KV cache's budget; a request waits until it fits
    prefix_cache_gb: float = DEFAULT_GB  # finished prompts' keys and values kept for prompts starting alike; 0: off
    prefill_chunk: int | None = None  # prompt tokens prefilled a round while others decode (None: the loop's own)
    per_request_spec_decode_metrics: str = "none"  # "summary": each answer's `metrics.speculative_decoding` (vLLM's)
    speculate_up_to: int | None = (
        None  # a switch: up to this many decoding requests draft (None: the budget sizes trees)
    )
    speculation: str | None = None  # budget, fixed or off (runtime/sizing/policy.py; None: by the switches given)


class Completions:
    """The serving state (engine, worker, metrics, a tokenizer and a thread of its own) and the request logic."""

    def __init__(self, engine: Engine, config: ServeConfig) -> None:
        self.engine, self.config = engine, config
        cache_bytes = int(config.prefix_cache_gb * 2**30)
        prefix_cache = PrefixCache(cache_bytes, engine.drafter.feature_layers) if cache_bytes else None
        self.metrics = ServerMetrics(pool_of(engine.drafter), prefix_cache)
        self.worker = Worker(
            engine,
            self.metrics,
            config.max_queue,
            config.time_limit_s,
            config.step_aside_queue,
            config.min_acceptance,
            config.max_batch,
            int(config.kv_cache_gb * 2**30),
            config.prefill_chunk,
            speculate_up_to=config.speculate_up_to,
            prefix_cache=prefix_cache,
            speculation=config.speculation,
        )
        self.tokenizer = copy.deepcopy(engine.tokenizer)  # the worker decodes with its own; a fast one is not shared
        self.encoder = ThreadPoolExecutor(1, thread_name_prefix="headstart-encode")
        self.longest_token = max(map(len, self.tokenizer.get_vocab()), default=1)

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()
        self.encoder.shutdown(wait=False, cancel_futures=True)

    def error(self, e: APIError, path: str, headers: dict | None = None) -> JSONResponse:
        """OpenAI's error body for `e`, counted under `path`'s label; a 429 says when to retry."""
        self.metrics.requests.labels(endpoint=path_label(path), status=str(e.status)).inc()
        if e.status == 429:
            headers = {**(headers or {}), "Retry-After": str(self.config.retry_after_s)}
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    # ---- checks and tokenising ---------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(
                400,
                f"model '{clip(name)}' is not served here; this server serves '{self.config.model_name}'",
                param="model",
                code="model_not_found",
            )

    def too_long(self, chars: int, param: str) -> None:
        """Refuse text that cannot fit the context whatever its tokens, before spending time on tokenising it."""
        max_len = self.engine.target.max_len
        if chars > self.longest_token * max_len:
            raise APIError(
                400,
                f"the {param} ({chars} characters) cannot fit the model's context of {max_len} tokens",
                param=param,
                code="context_length_exceeded",
            )

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.encoder, fn, *args)

    async def encode_chat(self, messages: list[dict]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise APIError(400, f"model {self.config.model_name} has no chat template: use /v1/completions")
        self.too_long(sum(len(m["content"]) for m in messages), "messages")
        try:
            return await self.off_loop(chat_ids, self.tokenizer, messages)
        except Exception as e:
            raise APIError(400, f"messages do not fit the chat template: {clip(str(e))}", param="messages") from e

    async def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self.too_long(len(prompt), "prompt")
            return await self.off_loop(lambda text: self.tokenizer(text).input_ids, prompt)
        vocab = self.engine.target.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)

    # ---- one request ---------------------------------------------------------------------------------------

    def submit(self, body, prompt_ids: list[int], chat: bool) -> Job:
        """Queue the request on the worker, or refuse it (context, a full queue, a dead worker)."""
        max_len = self.engine.target.max_len
        if not prompt_ids:
            raise APIError(400, "empty prompt", param="prompt")
        room = max_len - len(prompt_ids)
        max_tokens = body.max_tokens if body.max_tokens is not None else min(self.config.default_max_tokens, room)
        if max_tokens > room or room < 1:
            raise APIError(
                400,
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max(max_tokens, 1)}) exceeds the "
                f"model's context of {max_len} tokens",
                param="max_tokens" if body.max_tokens is not None else "messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        sampling = SamplingParams(temperature=body.sampling_temperature, top_p=body.sampling_top_p)
        job = Job(prompt_ids, sampling, max_tokens, body.seed, body.stop_strings(), asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFullError:
            raise APIError(
                429,
                f"the server is busy: {self.config.max_queue} requests are waiting; retry later",
                type_="server_busy",
                code="queue_full",
            ) from None
        except WorkerDeadError:
            raise APIError(503, "the model worker is not running", type_="server_error", code="worker_dead") from None
        return job

    async def answer(self, body, prompt_ids: list[int], request: Request, chat: bool) -> Response:
        """The request's answer: whole, or streamed when it asks; a client that leaves cancels its job."""
        job = self.submit(body, prompt_ids, chat)
        head = {
            "id": completion_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": self.config.model_name,
        }
        if body.streaming:
            events = self.stream_events(job, head, chat, body.stream_options, len(prompt_ids), request.url.path)
            return StreamingResponse(events, media_type="text/event-stream")
        return await self.whole(job, head, chat, body.return_token_ids, len(prompt_ids), request)

    def metrics_of(self, job: Job) -> dict:
        """The answer's `metrics` field, as vLLM's --per-request-spec-decode-metrics summary writes it ({} if off)."""
        if self.config.per_request_spec_decode_metrics == "none":
            return {}
        return {"metrics": {"speculative_decoding": job.stats.spec_decode()}}

    @staticmethod
    def extra(job: Job) -> dict:
        """headstart's own figures of a finished request (the `headstart` field of the answer)."""
        stats = job.stats.as_dict()
        keep = ("acceptance_length", "target_passes", "accepted_per_depth", "draft_ms", "verify_ms", "tokens_per_s")
        return {**{k: stats[k] for k in keep}, "time_to_first_token_s": job.first_token_s, "timed_out": job.timed_out}

    async def whole(
        self, job: Job, head: dict, chat: bool, token_ids: bool, n_prompt: int, request: Request
    ) -> Response:
        path, parts = request.url.path, []
        left = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            while True:
                event = asyncio.ensure_future(job.events.get())
                await asyncio.wait({event, left}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if left.done():  # the client went away: free the queue slot or stop after this round
                    event.cancel()
                    self.worker.cancel(job)
                    self.metrics.requests.labels(endpoint=path_label(path), status="499").inc()
                    return Response(status_code=499)
                if not event.done():
                    event.cancel()
                    if not self.worker.alive and not job.events.qsize():
                        raise APIError(503, "the model worker stopped", type_="server_error", code="worker_dead")
                    continue
                kind, value = event.result()
                if kind == "delta":
                    parts.append(value)
                elif kind == "error":
                    raise APIError(500, value, type_="server_error")
                else:
                    break
        finally:
            left.cancel()
        self.metrics.requests.labels(endpoint=path_label(path), status="200").inc()
        self.metrics.prompt_tokens.inc(n_prompt)
        return JSONResponse(
            {
                **head,
                "choices": [choice(chat, "".join(parts), value, token_ids=job.token_ids if token_ids else None)],
                "usage": usage(n_prompt, job.stats.new_tokens),
                "headstart": self.extra(job),
                **self.metrics_of(job),
            }
        )

    async def stream_events(
        self, job: Job, head: dict, chat: bool, options, n_prompt: int, path: str
    ) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        status = "499"  # unless the stream completes
        try:
            first = True
            while True:
                kind, value = await job.events.get()
                if kind == "delta":
                    yield sse({**head, "choices": [choice(chat, value, None, first, stream=True)]})
                    first = False
                elif kind == "error":
                    status = "500"
                    yield sse(APIError(500, value, type_="server_error").body())
                    break
                else:
                    final = {
                        **head,
                        "choices": [choice(chat, None, value, first, stream=True)],
                        "headstart": self.extra(job),
                    }
                    last = {**head, "choices": [], "usage": usage(n_prompt, job.stats.new_tokens)}
                    with_usage = options is not None and options.include_usage
                    (last if with_usage else final).update(self.metrics_of(job))  # on the last chunk, as vLLM
                    yield sse(final)
                    if with_usage:
                        yield sse(last)
                    status = "200"
                    break
            yield "data: [DONE]\n\n"
            self.metrics.prompt_tokens.inc(n_prompt)
        finally:
            self.worker.cancel(job)  # a no-op once the job is done; frees the worker if the client went away
            self.metrics.requests.labels(endpoint=path_label(path), status=status).inc()


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (its body was read already: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
