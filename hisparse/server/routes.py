"""The HTTP routes. Each handler takes what it needs from `request.app.state` (set up by `app.build_app` and its
lifespan: `engine`, `config`, `metrics`, and the endpoints' `completion`, `chat` and `tokens`). The handlers have
no docstrings: FastAPI would publish them in /openapi.json."""

from __future__ import annotations

import asyncio
from importlib.metadata import version
from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from .errors import APIError
from .protocol import ChatRequest, CompletionRequest, DetokenizeRequest, now

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> Response:
    engine = request.app.state.engine
    if engine.fatal is not None:    # the DCP group broke: the server is shutting down
        raise APIError(503, f"engine stopped: {engine.fatal}", code="engine_stopped", kind="server_error")
    return Response(status_code=200)


@router.get("/metrics")
async def prom(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/reset_prefix_cache", response_model=None)
async def reset_prefix_cache(request: Request) -> dict[str, Any]:
    engine = request.app.state.engine
    if engine.fatal is not None:
        raise APIError(503, f"engine stopped: {engine.fatal}", code="engine_stopped", kind="server_error")
    return {"dropped_pages": await asyncio.wrap_future(engine.reset_prefix_cache())}


@router.get("/v1/models", response_model=None)
async def models(request: Request) -> dict[str, Any]:
    cfg = request.app.state.config
    return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": now(),
                                        "owned_by": "hisparse", "max_model_len": cfg.max_model_len}]}


@router.get("/version", response_model=None)
async def server_version() -> dict[str, str]:
    return {"version": version("hisparse")}


@router.post("/tokenize")
async def tokenize(request: Request, body: dict[str, Any] = Body()) -> Response:
    return await request.app.state.tokens.tokenize(body)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> Response:
    return await request.app.state.tokens.detokenize(req)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Response:
    return await request.app.state.completion.create(req, request)


@router.post("/v1/chat/completions")
async def chat(req: ChatRequest, request: Request) -> Response:
    return await request.app.state.chat.create(req, request)
