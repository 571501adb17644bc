"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (streaming and not), /v1/models,
/health and /metrics. Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import Engine
from ..engine.request import RequestError, RequestOutput
from .chat import ChatEncoder
from .engine_client import AsyncEngine
from .errors import APIError, error_body, error_response, validation_error
from .metrics import Metrics
from .middleware import ApiKeyAuth, BodyGuard
from .output_parser import MarkerIds, OutputParser, ParsedDelta
from .protocol import ChatRequest, CompletionRequest, SamplingFields, Usage, now

log = logging.getLogger("hisparse.server")
COMPLETION_DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 1024         # chat has no OpenAI default; bounded so admission can reserve it
DISCONNECT_POLL_S = 0.25               # how often a non-streaming request checks that its client is still there
CLIENT_CLOSED = 499                    # the status of a response nobody is left to read (nginx's convention)


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    max_model_len: int
    api_key: str | None = None
    debug_hooks: bool = False   # accept `debug_forced_token_ids` (tests of the output parsers)
    max_request_bytes: int | None = None   # request body limit; None: sized from max_model_len
    read_timeout_s: float = 30.0           # a request body must arrive within this (headers: connection.py)

    @property
    def body_limit(self) -> int:
        """The request body limit: 1 MiB plus 16 bytes per token of max_model_len (a JSON token-id list takes
        at most ~8 bytes per token, text a few bytes per token)."""
        return self.max_request_bytes if self.max_request_bytes is not None else (1 << 20) + 16 * self.max_model_len


async def collect(request: Request, outputs: AsyncIterator[RequestOutput], each: Callable[[RequestOutput], None]
                  ) -> RequestOutput | None:
    """Consume a non-streaming request's outputs, passing each to `each`; returns the last one, or None if the
    client disconnected first. Then the outputs are closed, which aborts the request in the engine, as a dropped
    stream does: a client that gives up on a long prompt does not leave the server prefilling it for nobody (and a
    graceful shutdown does not wait for it)."""
    async def consume() -> RequestOutput | None:
        last = None
        async with aclosing(outputs) as stream:
            async for last in stream:
                each(last)
        return last

    task = asyncio.ensure_future(consume())
    while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            return None
    return task.result()


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def build_app(engine: Engine, tokenizer: MistralTokenizer, cfg: ServerConfig) -> FastAPI:
    metrics = Metrics()
    engine.on_step = metrics.observe
    text_tok = tokenizer.instruct_tokenizer.tokenizer
    markers = MarkerIds.of(text_tok.get_special_token)
    chat_encoder = ChatEncoder(tokenizer)
    state: dict[str, AsyncEngine] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["client"] = AsyncEngine(engine)
        yield
        state["client"].shutdown()

    app = FastAPI(title="hisparse", lifespan=lifespan)

    # ---- errors ----
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        chat = request.url.path.endswith("/chat/completions")
        return error_response(APIError(e.status, str(e), "messages" if chat and e.field == "prompt" else e.field))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return error_response(validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail), code=str(e.status_code)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error",
                                       kind="server_error"))

    app.add_middleware(BodyGuard, max_bytes=cfg.body_limit, timeout_s=cfg.read_timeout_s)
    if cfg.api_key:    # added last: the outer layer, so an unauthenticated body is never read
        app.add_middleware(ApiKeyAuth, api_key=cfg.api_key)

    # ---- helpers ----
    def check_common(req: SamplingFields) -> None:
        if req.model and req.model != cfg.model_name:   # no model named: the one served
            raise APIError(404, f"The model `{req.model}` does not exist; this server serves `{cfg.model_name}`.",
                           "model", "model_not_found")
        if req.debug_forced_token_ids is not None and not cfg.debug_hooks:
            raise APIError(400, "debug_forced_token_ids: only accepted by a server started with --debug-hooks",
                           "debug_forced_token_ids")

    def submit(prompt: list[int], req: SamplingFields, max_tokens: int, prefix: str
               ) -> tuple[str, AsyncIterator[RequestOutput]]:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        return rid, state["client"].submit(prompt, req.sampling_params(max_tokens), rid)

    def failed(out: RequestOutput) -> APIError:
        return APIError(500, f"generation failed: {out.error}", code="internal_error", kind="server_error")

    # ---- routes ----
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if engine.fatal is not None:    # the DCP group broke: the server is shutting down
            raise APIError(503, f"engine stopped: {engine.fatal}", code="engine_stopped", kind="server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": now(),
                                            "owned_by": "hisparse", "max_model_len": cfg.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_common(req)
        prompt = await asyncio.to_thread(text_tok.encode, req.prompt, True, False) if isinstance(req.prompt, str) \
            else req.prompt      # tokenising a long prompt must not block the event loop
        rid, outputs = submit(prompt, req, req.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS, "cmpl")
        created = now()

        def chunk(text: str, reason: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": cfg.model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

        if req.stream:
            async def events():
                async with aclosing(outputs) as stream:
                    async for out in stream:
                        if out.error:
                            yield sse(error_body(failed(out).message, "server_error", None, "internal_error"))
                            break
                        if out.text_delta or out.finished:
                            yield sse(chunk(out.text_delta, out.finish_reason if out.finished else None))
                        if out.finished and req.include_usage:
                            yield sse({**chunk("", None), "choices": [],
                                       "usage": Usage.of(out.prompt_tokens, out.output_tokens).model_dump()})
                yield sse("[DONE]")
            return StreamingResponse(events(), media_type="text/event-stream")

        pieces: list[str] = []
        last = await collect(request, outputs, lambda out: pieces.append(out.text_delta))
        if last is None:
            return Response(status_code=CLIENT_CLOSED)
        text = "".join(pieces)
        if last.error:
            raise failed(last)
        return {**chunk(text, last.finish_reason), "usage": Usage.of(last.prompt_tokens, last.output_tokens).model_dump()}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        check_common(req)
        prompt = await asyncio.to_thread(chat_encoder.encode, req)
        max_tokens = req.max_completion_tokens or req.max_tokens or \
            max(1, min(CHAT_DEFAULT_MAX_TOKENS, cfg.max_model_len - len(prompt)))
        rid, outputs = submit(prompt, req, max_tokens, "chatcmpl")
        parser = OutputParser(markers, text_tok.decode, tuple(req.stop))
        created = now()

        def reason_of(out: RequestOutput) -> str:
            return "tool_calls" if parser.calls and out.finish_reason == "stop" else out.finish_reason

        def chunk(delta: dict, reason: str | None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": cfg.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        def delta_dict(d: ParsedDelta) -> dict:
            out = {}
            if d.reasoning:
                out["reasoning_content"] = d.reasoning
            if d.content:
                out["content"] = d.content
            if d.tool_calls:
                out["tool_calls"] = d.tool_calls
            return out

        if req.stream:
            async def events():
                yield sse(chunk({"role": "assistant", "content": ""}, None))
                async with aclosing(outputs) as stream:
                    async for out in stream:
                        if out.error:
                            yield sse(error_body(failed(out).message, "server_error", None, "internal_error"))
                            break
                        d = parser.push(out.new_token_ids)
                        if out.finished:
                            d = d.merge(parser.finish())
                        if d:
                            yield sse(chunk(delta_dict(d), None))
                        if out.finished:
                            yield sse(chunk({}, reason_of(out)))
                            if req.include_usage:
                                yield sse({**chunk({}, None), "object": "chat.completion.chunk", "choices": [],
                                           "usage": Usage.of(out.prompt_tokens, out.output_tokens).model_dump()})
                yield sse("[DONE]")
            return StreamingResponse(events(), media_type="text/event-stream")

        last = await collect(request, outputs, lambda out: parser.push(out.new_token_ids))
        if last is None:
            return Response(status_code=CLIENT_CLOSED)
        if last.error:
            raise failed(last)
        parser.finish()
        return {"id": rid, "object": "chat.completion", "created": created, "model": cfg.model_name,
                "choices": [{"index": 0, "message": parser.message(), "logprobs": None,
                             "finish_reason": reason_of(last)}],
                "usage": Usage.of(last.prompt_tokens, last.output_tokens).model_dump()}

    return app
