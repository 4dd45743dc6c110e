"""The routes (OpenAI's /v1/ ones, /health, /metrics) and the handlers that turn every error into OpenAI's error
body; the work behind them is `completions.Completions`, found on `app.state.completions`."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from headstart.runtime.apps.server.completions import Completions
from headstart.runtime.apps.server.schema import APIError, ChatRequest, CompletionRequest, clip

router = APIRouter()


def served(request: Request) -> Completions:
    return request.app.state.completions


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> JSONResponse:
    s = served(request)
    alive = s.worker.alive
    body = {
        "status": "ok" if alive else "worker stopped",
        "queue_depth": s.worker.queue_depth,
        "running": len(s.worker.running),
        "model": s.config.model_name,
        "drafter": s.engine.drafter.name,
    }
    return JSONResponse(body, status_code=200 if alive else 503)


@router.api_route("/metrics", methods=["GET", "HEAD"])
async def prometheus(request: Request) -> Response:
    return PlainTextResponse(served(request).metrics.render(), media_type="text/plain; version=0.0.4")


@router.api_route("/v1/models", methods=["GET", "HEAD"])
async def models(request: Request) -> dict:
    entry = {"id": served(request).config.model_name, "object": "model", "created": 0, "owned_by": "headstart"}
    return {"object": "list", "data": [entry]}


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request) -> Response:
    s = served(request)
    s.check_model(body.model)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    return await s.answer(body, await s.encode_chat(messages), request, chat=True)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    s = served(request)
    s.check_model(body.model)
    return await s.answer(body, await s.encode_prompt(body.prompt), request, chat=False)


def install_error_handlers(app: FastAPI, s: Completions, api_key: str | None) -> None:
    """Every error as OpenAI's error body (validation 400s, 404/405, APIError, anything unexpected: 500), counted;
    with `api_key`, /v1/ routes need `Authorization: Bearer <api_key>` (else 401)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            message = f"invalid JSON body: {first.get('ctx', {}).get('error', message)}"
        param = clip(".".join(loc)) if loc else None
        text = f"{param}: {message}" if param else message
        return s.error(APIError(400, text, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        e = APIError(exc.status_code, str(exc.detail), code=str(exc.status_code))
        return s.error(e, request.url.path, exc.headers)  # a 405 keeps its Allow header

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return s.error(exc, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return s.error(APIError(500, f"internal error: {type(exc).__name__}", type_="server_error"), request.url.path)

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authorize(request: Request, call_next):
            if request.url.path.startswith("/v1/"):
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):  # constant time: the key leaks no prefix
                    e = APIError(
                        401,
                        "invalid or missing API key: send 'Authorization: Bearer <key>'",
                        type_="authentication_error",
                        code="invalid_api_key",
                    )
                    return s.error(e, request.url.path, {"WWW-Authenticate": "Bearer"})
            return await call_next(request)
