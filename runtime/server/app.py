"""The FastAPI application: OpenAI routes over the model worker, health and Prometheus metrics.

    app = build_app(engine, ServeConfig("smollm2-135m-instruct"))   # then uvicorn.run(app, ...)

The event loop only moves bytes: bodies are capped (`BodyLimit`, 413), tokenisation and the chat
template run on a thread of their own, generation on the worker's. A client that leaves cancels its
request within one decode round, streaming or not, and a request that leaves the queue gives its slot
back. Every error, 500s included, is OpenAI's error body and is counted in /metrics under a bounded
set of path labels.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from headstart.runtime.engine import Engine
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.server.metrics import ServerMetrics, path_label
from headstart.runtime.server.schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    choice,
    clip,
    completion_id,
    now,
    usage,
)
from headstart.runtime.server.worker import Job, QueueFullError, Worker, WorkerDeadError
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


class BodyLimit:
    """ASGI middleware: reads a request body up to `limit` bytes (413 past it, before anything parses it),
    then hands it to the app; later `receive` calls go to the client (the app waits there for a disconnect)."""

    def __init__(self, app: FastAPI, limit: int, reject) -> None:
        self.app, self.limit, self.reject = app, limit, reject
        self.state = app.state  # the worker and the metrics, for whoever holds the wrapped app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            return await self.reject(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:  # a chunked body with no length, or one longer than it said
                return await self.reject(scope, receive, send)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        return await self.app(scope, replay, send)


def build_app(engine: Engine, config: ServeConfig, api_key: str | None = None) -> BodyLimit:
    """The app; with `api_key`, every /v1/ request needs `Authorization: Bearer <api_key>` (else 401), /health and
    /metrics stay open. The key is kept out of `config`, which the CLI prints."""
    metrics = ServerMetrics()
    worker = Worker(engine, metrics, config.max_queue, config.time_limit_s, config.step_aside_queue,
                    config.min_acceptance)  # fmt: skip
    tokenizer = copy.deepcopy(engine.tokenizer)  # the worker decodes with its own; a fast tokenizer is not shared
    encoder = ThreadPoolExecutor(1, thread_name_prefix="headstart-encode")

    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.stop()
        encoder.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="headstart", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics

    def error(e: APIError, path: str, headers: dict | None = None) -> JSONResponse:
        metrics.requests.labels(endpoint=path_label(path), status=str(e.status)).inc()
        if e.status == 429:
            headers = {**(headers or {}), "Retry-After": str(config.retry_after_s)}
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            message = f"invalid JSON body: {first.get('ctx', {}).get('error', message)}"
        param = clip(".".join(loc)) if loc else None
        text = f"{param}: {message}" if param else message
        return error(APIError(400, text, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        e = APIError(exc.status_code, str(exc.detail), code=str(exc.status_code))
        return error(e, request.url.path, exc.headers)  # a 405 keeps its Allow header

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return error(exc, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error(APIError(500, f"internal error: {type(exc).__name__}", type_="server_error"), request.url.path)

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authorize(request: Request, call_next):
            if request.url.path.startswith("/v1/"):
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):  # constant time: the key leaks no prefix
                    e = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                 type_="authentication_error", code="invalid_api_key")  # fmt: skip
                    return error(e, request.url.path, {"WWW-Authenticate": "Bearer"})
            return await call_next(request)

    async def reject_body(scope, receive, send) -> None:
        e = APIError(413, f"request body larger than {config.max_body_bytes} bytes", code="request_too_large")
        await error(e, scope["path"])(scope, receive, send)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        alive = worker.alive
        body = {"status": "ok" if alive else "worker stopped", "queue_depth": worker.queue_depth,
                "model": config.model_name, "drafter": engine.drafter.name}  # fmt: skip
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict:
        entry = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "headstart"}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        check_model(body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        if not tokenizer.chat_template:
            raise APIError(400, f"model {config.model_name} has no chat template: use /v1/completions")
        too_long(sum(len(m["content"]) for m in messages), "messages")
        try:
            ids = await off_loop(encode_chat, messages)
        except Exception as e:
            raise APIError(400, f"messages do not fit the chat template: {clip(str(e))}", param="messages") from e
        return await run(body, ids, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if isinstance(body.prompt, str):
            too_long(len(body.prompt), "prompt")
            ids = await off_loop(lambda text: tokenizer(text).input_ids, body.prompt)
        else:
            vocab = engine.target.model.config.vocab_size
            if any(not 0 <= t < vocab for t in body.prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            ids = list(body.prompt)
        return await run(body, ids, request, chat=False)

    def encode_chat(messages: list[dict]) -> list[int]:
        return chat_ids(tokenizer, messages)

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(encoder, fn, *args)

    longest_token = max(map(len, tokenizer.get_vocab()), default=1)

    def too_long(chars: int, param: str) -> None:
        """Refuse text that cannot fit the context whatever its tokens, before spending time on tokenising it."""
        if chars > longest_token * engine.target.max_len:
            raise APIError(400, f"the {param} ({chars} characters) cannot fit the model's context of "
                           f"{engine.target.max_len} tokens", param=param, code="context_length_exceeded")  # fmt: skip

    def check_model(name: str) -> None:
        if name != config.model_name:
            raise APIError(400, f"model '{clip(name)}' is not served here; this server serves '{config.model_name}'",
                           param="model", code="model_not_found")  # fmt: skip

    async def run(body, prompt_ids: list[int], request: Request, chat: bool) -> Response:
        path = request.url.path
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
        sampling = SamplingParams(temperature=body.sampling_temperature, top_p=body.sampling_top_p)
        job = Job(prompt_ids, sampling, max_tokens, body.seed, body.stop_strings(), asyncio.get_running_loop())
        try:
            worker.submit(job)
        except QueueFullError:
            raise APIError(429, f"the server is busy: {config.max_queue} requests are waiting; retry later",
                           type_="server_busy", code="queue_full") from None  # fmt: skip
        except WorkerDeadError:
            raise APIError(503, "the model worker is not running", type_="server_error", code="worker_dead") from None
        cid, created = completion_id("chatcmpl" if chat else "cmpl"), now()
        head = {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": config.model_name}  # fmt: skip

        def extra() -> dict:
            stats = job.stats.as_dict()
            keep = ("acceptance_length", "target_passes", "accepted_per_depth", "draft_ms", "verify_ms", "tokens_per_s")
            return {**{k: stats[k] for k in keep}, "time_to_first_token_s": job.first_token_s,
                    "timed_out": job.timed_out}  # fmt: skip

        if body.streaming:
            return StreamingResponse(
                stream_events(job, head, chat, extra, body.stream_options, len(prompt_ids), path),
                media_type="text/event-stream",
            )
        parts: list[str] = []
        left = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            while True:
                event = asyncio.ensure_future(job.events.get())
                await asyncio.wait({event, left}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if left.done():  # the client went away: free the queue slot or stop after this round
                    event.cancel()
                    worker.cancel(job)
                    metrics.requests.labels(endpoint=path_label(path), status="499").inc()
                    return Response(status_code=499)
                if not event.done():
                    event.cancel()
                    if not worker.alive and not job.events.qsize():
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
        metrics.requests.labels(endpoint=path_label(path), status="200").inc()
        metrics.prompt_tokens.inc(len(prompt_ids))
        token_ids = job.token_ids if body.return_token_ids else None
        return JSONResponse({
            **head, "choices": [choice(chat, "".join(parts), value, token_ids=token_ids)],
            "usage": usage(len(prompt_ids), job.stats.new_tokens), "headstart": extra(),
        })  # fmt: skip

    async def stream_events(job: Job, head: dict, chat: bool, extra, options, n_prompt: int, path: str
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
            worker.cancel(job)  # a no-op once the job is done; frees the worker if the client went away
            metrics.requests.labels(endpoint=path_label(path), status=status).inc()

    return BodyLimit(app, config.max_body_bytes, reject_body)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (its body was read already: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
