"""The FastAPI application: OpenAI routes over the model worker, health and Prometheus metrics.

    app = build_app(engine, ServeConfig("smollm2-135m-instruct"))   # then uvicorn.run(app, ...)

The event loop only moves bytes: bodies are capped (`BodyLimit`, 413), tokenisation and the chat
template run on a thread of their own, generation on the worker's. Routes and error handlers are in routes.py,
the work behind them in completions.py; this module composes them. A client that leaves cancels its
request within one decode round, streaming or not, and a request that leaves the queue gives its slot
back. Every error, 500s included, is OpenAI's error body and is counted in /metrics under a bounded
set of path labels.
"""

from __future__ import annotations

from fastapi import FastAPI

from headstart.runtime.apps.server.completions import Completions, ServeConfig
from headstart.runtime.apps.server.routes import install_error_handlers, router
from headstart.runtime.apps.server.schema import APIError
from headstart.runtime.engine import Engine

__all__ = ["BodyLimit", "ServeConfig", "build_app"]


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


def build_app(engine: Engine, config: ServeConfig, api_key: str | None = None, worker_thread: bool = True) -> BodyLimit:
    """The app; with `api_key`, every /v1/ request needs `Authorization: Bearer <api_key>` (else 401), /health and
    /metrics stay open. The key is kept out of `config`, which the CLI prints. `worker_thread`: the app starts the
    model worker on a thread of its own; False: the caller runs `app.state.worker.serve()` (and stops it)."""
    completions = Completions(engine, config)
    if not worker_thread:
        completions.worker.bind()

    async def lifespan(app: FastAPI):
        if worker_thread:
            completions.start()
        yield
        if worker_thread:
            completions.stop()

    app = FastAPI(title="headstart", lifespan=lifespan)
    app.state.completions = completions
    app.state.worker, app.state.metrics = completions.worker, completions.metrics
    install_error_handlers(app, completions, api_key)
    app.include_router(router)

    async def reject_body(scope, receive, send) -> None:
        e = APIError(413, f"request body larger than {config.max_body_bytes} bytes", code="request_too_large")
        await completions.error(e, scope["path"])(scope, receive, send)

    return BodyLimit(app, config.max_body_bytes, reject_body)
