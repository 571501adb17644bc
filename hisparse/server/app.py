"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (streaming and not, n choices, logprobs,
echo), /v1/models, /health, /metrics, and vLLM's /tokenize, /detokenize and /version. Errors use OpenAI's shape
{"error": {"message", "type", "param", "code"}}.

`build_app` assembles the application: its state (`app.state`), the error handlers, the request guards and the
routes (routes.py); the lifespan starts the engine thread and builds the endpoints' classes (serving_*.py)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import Engine
from ..engine.request import RequestError
from .config import ServerConfig
from .engine_client import AsyncEngine
from .errors import APIError, error_response, validation_error
from .metrics import Metrics
from .middleware import ApiKeyAuth, BodyGuard, HeaderGuard
from .routes import router
from .serving_base import TextCodec
from .serving_chat import ServingChat
from .serving_completion import ServingCompletion
from .serving_tokens import ServingTokens


log = logging.getLogger("hisparse.server")


async def api_error(request: Request, e: APIError) -> Response:
    return error_response(e)


async def request_error(request: Request, e: RequestError) -> Response:
    """The engine's refusal of a request; its `prompt` is a chat request's `messages`."""
    chat = request.url.path.endswith("/chat/completions")
    return error_response(APIError(e.status, str(e), "messages" if chat and e.field == "prompt" else e.field))


async def invalid_body(request: Request, e: RequestValidationError) -> Response:
    return error_response(validation_error(e))


async def http_error(request: Request, e: StarletteHTTPException) -> Response:
    return error_response(APIError(e.status_code, str(e.detail), code=str(e.status_code)))


async def internal_error(request: Request, e: Exception) -> Response:
    log.exception("unhandled error")
    return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error",
                                   kind="server_error"))


EXCEPTION_HANDLERS = ((APIError, api_error), (RequestError, request_error), (RequestValidationError, invalid_body),
                      (StarletteHTTPException, http_error), (Exception, internal_error))


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the engine thread and the worker pool for CPU-heavy request work, and build the endpoints over them;
    stop both when the server stops."""
    state = app.state
    client = AsyncEngine(state.engine)
    pool = ThreadPoolExecutor(state.config.cpu_workers, thread_name_prefix="hisparse-cpu")
    codec = TextCodec(state.tokenizer)
    state.completion = ServingCompletion(client, codec, state.config, pool)
    state.chat = ServingChat(client, codec, state.config, pool)
    state.tokens = ServingTokens(client, codec, state.config, pool)
    yield
    client.shutdown()
    pool.shutdown(wait=False, cancel_futures=True)


def build_app(engine: Engine, tokenizer: MistralTokenizer, cfg: ServerConfig) -> FastAPI:
    """The application serving `engine` (not yet started: the lifespan starts it) under `cfg`."""
    docs = {} if cfg.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="hisparse", lifespan=lifespan, **docs)
    app.state.engine, app.state.tokenizer, app.state.config = engine, tokenizer, cfg
    app.state.metrics = Metrics()
    engine.on_step = app.state.metrics.observe
    for exc, handler in EXCEPTION_HANDLERS:
        app.add_exception_handler(exc, handler)
    app.add_middleware(BodyGuard, max_bytes=cfg.body_limit, timeout_s=cfg.read_timeout_s)
    app.add_middleware(HeaderGuard, max_bytes=cfg.max_header_bytes)
    if cfg.api_key:    # added last: the outer layer, so an unauthenticated body is never read
        app.add_middleware(ApiKeyAuth, api_key=cfg.api_key)
    app.include_router(router)
    return app
