"""The FastAPI application: OpenAI routes over the model worker, health and Prometheus metrics.

app = build_app(engine, "smollm2-135m-instruct")   # then uvicorn.run(app, ...)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from headstart.runtime.engine import Engine
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.server.metrics import ServerMetrics
from headstart.runtime.server.schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    choice,
    completion_id,
    now,
    usage,
)
from headstart.runtime.server.worker import Job, QueueFullError, Worker
from starlette.exceptions import HTTPException as StarletteHTTPException


@dataclass
class ServeConfig:
    model_name: str  # the id clients pass as `model`
    max_queue: int = 64  # waiting requests; one more gets a 429
    time_limit_s: float = 300.0  # per request, from the start of its generation
    default_max_tokens: int = 512  # when a request gives none (capped by what the context has left)
    retry_after_s: int = 5  # the Retry-After of a 429
    step_aside_queue: int | None = None  # decode plainly while more requests than this wait; None = never
    min_acceptance: float | None = None  # decode plainly a while when recent rounds accept less; None = never


def build_app(engine: Engine, config: ServeConfig) -> FastAPI:
    metrics = ServerMetrics()
    worker = Worker(engine, metrics, config.max_queue, config.time_limit_s, config.step_aside_queue,
                    config.min_acceptance)  # fmt: skip

    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="headstart", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics

    def error(e: APIError, endpoint: str) -> JSONResponse:
        metrics.requests.labels(endpoint=endpoint, status=str(e.status)).inc()
        headers = {"Retry-After": str(config.retry_after_s)} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            message = f"invalid JSON body: {first.get('ctx', {}).get('error', message)}"
        param = ".".join(loc) or None
        text = f"{param}: {message}" if param else message
        return error(APIError(400, text, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)), request.url.path)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return error(exc, request.url.path)

    @app.get("/health")
    async def health() -> dict:
        alive = worker.thread.is_alive()
        return {"status": "ok" if alive else "worker stopped", "queue_depth": worker.jobs.qsize(),
                "model": config.model_name, "drafter": engine.drafter.name}  # fmt: skip

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "headstart"}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        check_model(body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        if not engine.tokenizer.chat_template:
            raise APIError(400, f"model {config.model_name} has no chat template: use /v1/completions")
        try:
            ids = engine.encode_chat(messages)
        except Exception as e:
            raise APIError(400, f"messages do not fit the chat template: {e}", param="messages") from e
        return await run(body, ids, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if isinstance(body.prompt, str):
            ids = engine.tokenizer(body.prompt).input_ids
        else:
            vocab = engine.target.model.config.vocab_size
            if any(not 0 <= t < vocab for t in body.prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            ids = list(body.prompt)
        return await run(body, ids, request, chat=False)

    def check_model(name: str) -> None:
        if name != config.model_name:
            raise APIError(400, f"model '{name}' is not served here; this server serves '{config.model_name}'",
                           param="model", code="model_not_found")  # fmt: skip

    async def run(body, prompt_ids: list[int], request: Request, chat: bool) -> Response:
        endpoint = request.url.path
        if not prompt_ids:
            raise APIError(400, "empty prompt", param="prompt")
        room = engine.target.max_len - len(prompt_ids)
        max_tokens = body.max_tokens if body.max_tokens is not None else min(config.default_max_tokens, room)
        if max_tokens > room or room < 1:
            raise APIError(
                400,
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max(max_tokens, 1)}) exceeds the "
                f"model's context of {engine.target.max_len} tokens",
                param="max_tokens" if body.max_tokens is not None else "messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p)
        job = Job(prompt_ids, sampling, max_tokens, body.seed, body.stop_strings(), asyncio.get_running_loop())
        try:
            worker.submit(job)
        except QueueFullError:
            raise APIError(429, f"the server is busy: {config.max_queue} requests are waiting; retry later",
                           type_="server_busy", code="queue_full") from None  # fmt: skip
        cid, created = completion_id("chatcmpl" if chat else "cmpl"), now()
        head = {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": config.model_name}  # fmt: skip

        def extra() -> dict:
            stats = job.stats.as_dict()
            keep = ("acceptance_length", "target_passes", "accepted_per_depth", "draft_ms", "verify_ms", "tokens_per_s")
            return {**{k: stats[k] for k in keep}, "time_to_first_token_s": job.first_token_s,
                    "timed_out": job.timed_out}  # fmt: skip

        if body.stream:
            return StreamingResponse(
                stream_events(job, head, chat, extra, body.stream_options, len(prompt_ids), endpoint),
                media_type="text/event-stream",
            )
        parts: list[str] = []
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:  # (the builtin TimeoutError only from Python 3.11)
                if await request.is_disconnected():
                    job.cancelled.set()
                    metrics.requests.labels(endpoint=endpoint, status="499").inc()
                    return Response(status_code=499)
                continue
            if kind == "delta":
                parts.append(value)
            elif kind == "error":
                raise APIError(500, value, type_="server_error")
            else:
                break
        metrics.requests.labels(endpoint=endpoint, status="200").inc()
        metrics.prompt_tokens.inc(len(prompt_ids))
        return JSONResponse({
            **head, "choices": [choice(chat, "".join(parts), value)],
            "usage": usage(len(prompt_ids), job.stats.new_tokens), "headstart": extra(),
        })  # fmt: skip

    async def stream_events(job: Job, head: dict, chat: bool, extra, options, n_prompt: int, endpoint: str
                            ) -> AsyncIterator[str]:  # fmt: skip
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
                    final = {**head, "choices": [choice(chat, None, value, first, stream=True)], "headstart": extra()}
                    yield sse(final)
                    if options is not None and options.include_usage:
                        yield sse({**head, "choices": [], "usage": usage(n_prompt, job.stats.new_tokens)})
                    status = "200"
                    break
            yield "data: [DONE]\n\n"
            metrics.prompt_tokens.inc(n_prompt)
        finally:
            job.cancelled.set()  # a no-op once the job is done; frees the worker if the client went away
            metrics.requests.labels(endpoint=endpoint, status=status).inc()

    return app


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
