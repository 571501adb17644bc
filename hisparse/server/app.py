"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (streaming and not, n choices, logprobs,
echo), /v1/models, /health, /metrics, and vLLM's /tokenize, /detokenize and /version. Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial
from contextlib import aclosing, asynccontextmanager, suppress
from importlib.metadata import version
from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from ..engine.engine import Engine
from ..engine.request import RequestError, RequestOutput
from .chat import ChatEncoder
from .config import ServerConfig
from .engine_client import AsyncEngine, Batch, merge_outputs
from .errors import APIError, error_body, error_response, validation_error
from .logprobs import CompletionLogprobs, chat_logprobs, prompt_logprobs
from .metrics import Metrics
from .middleware import ApiKeyAuth, BodyGuard, HeaderGuard
from .output_parser import MarkerIds, OutputParser, ParsedDelta
from .protocol import (ChatRequest, CompletionRequest, DetokenizeRequest, SamplingFields, TokenizeChatRequest,
                       TokenizeCompletionRequest, Usage, now)
from .render import render, sse

__all__ = ["ServerConfig", "build_app"]

log = logging.getLogger("hisparse.server")
COMPLETION_DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 1024         # chat has no OpenAI default; bounded so admission can reserve it
DISCONNECT_POLL_S = 0.25               # how often a non-streaming request checks that its client is still there
CLIENT_CLOSED = 499                    # the status of a response nobody is left to read (nginx's convention)


async def collect(request: Request, outputs: Batch,
                  each: Callable[[int, RequestOutput], None]) -> dict[int, RequestOutput] | None:
    """Consume a non-streaming request's outputs (choice index, output), passing each to `each`; returns the last
    output of every choice, or None if the client disconnected first. Then the outputs are closed, which aborts
    the requests in the engine, as a dropped stream does: a client that gives up on a long prompt does not leave
    the server prefilling it for nobody (and a graceful shutdown does not wait for it)."""
    async def consume() -> dict[int, RequestOutput]:
        last: dict[int, RequestOutput] = {}
        async with aclosing(outputs) as stream:
            async for i, out in stream:
                each(i, out)
                last[i] = out
        return last

    task = asyncio.ensure_future(consume())
    while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            return None
    return task.result()


class BatchStream(StreamingResponse):
    """A streamed response that owns its engine requests: however the response ends (finished, the client gone,
    an error), the batch is closed, which aborts whatever still runs."""

    def __init__(self, content: AsyncIterator[str], batch: Batch):
        super().__init__(content, media_type="text/event-stream")
        self.batch = batch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.batch.aclose()


def build_app(engine: Engine, tokenizer: MistralTokenizer, cfg: ServerConfig) -> FastAPI:
    metrics = Metrics()
    engine.on_step = metrics.observe
    text_tok = tokenizer.instruct_tokenizer.tokenizer
    markers = MarkerIds.of(text_tok.get_special_token)
    chat_encoder = ChatEncoder(tokenizer)
    state: dict[str, AsyncEngine] = {}
    pool = ThreadPoolExecutor(cfg.cpu_workers, thread_name_prefix="hisparse-cpu")

    async def offload(fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in the bounded worker pool: tokenizing, detokenizing, formatting logprobs and rendering a
        request's JSON take time in proportion to what the request carries, and the event loop (/health, every
        other client) must not wait for it."""
        return await asyncio.get_running_loop().run_in_executor(pool, partial(fn, *args))

    @lru_cache(maxsize=None)
    def piece(tid: int) -> str:
        return text_tok.decode([tid])

    def decode(ids: list[int]) -> str:
        """Text of ids; single tokens (every logprob entry) come from a cache."""
        return piece(ids[0]) if len(ids) == 1 else text_tok.decode(ids)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["client"] = AsyncEngine(engine)
        yield
        state["client"].shutdown()
        pool.shutdown(wait=False, cancel_futures=True)

    docs = {} if cfg.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="hisparse", lifespan=lifespan, **docs)

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
    app.add_middleware(HeaderGuard, max_bytes=cfg.max_header_bytes)
    if cfg.api_key:    # added last: the outer layer, so an unauthenticated body is never read
        app.add_middleware(ApiKeyAuth, api_key=cfg.api_key)

    # ---- helpers ----
    def check_model(model: str | None) -> None:
        if model and model != cfg.model_name:   # no model named: the one served
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{cfg.model_name}`.",
                           "model", "model_not_found")

    def encode_text(text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids; text the tokenizer cannot take (its regex gives up on some pathological inputs, such as
        a very long run of whitespace) is the client's problem: a 400 naming the prompt."""
        try:
            return text_tok.encode(text, add_special_tokens, False)
        except Exception as e:   # noqa: BLE001 - whatever the tokenizer raises is about this text
            raise APIError(400, f"prompt: the tokenizer cannot encode this text ({type(e).__name__}: {e})",
                           "prompt") from None

    def check_common(req: SamplingFields, prompts: int, logprobs: dict[str, int | None]) -> None:
        """The checks every generation request passes before anything is tokenized or queued: the model, the
        fan-out (`prompts` x n engine requests), logit_bias entries and logprobs counts (`logprobs`: field ->
        value) within the server's limits."""
        check_model(req.model)
        if prompts * req.n > cfg.max_batch_fanout:
            raise APIError(400, f"n: {prompts} prompt(s) x n={req.n} is {prompts * req.n} engine requests; this "
                                f"server accepts at most {cfg.max_batch_fanout} per request (--max-batch-fanout)",
                           "n", "fanout_too_large")
        if req.logit_bias and len(req.logit_bias) > cfg.max_logit_bias:
            raise APIError(400, f"logit_bias: {len(req.logit_bias)} entries; this server accepts at most "
                                f"{cfg.max_logit_bias} (--max-logit-bias)", "logit_bias")
        limit = min(cfg.max_logprobs, engine.vocab)
        for name, n in logprobs.items():
            if n is not None and n > limit:
                raise APIError(400, f"{name}: {n} alternatives per token; this server returns at most {limit} "
                                    "(--max-logprobs)", name)
        if req.debug_forced_token_ids is not None and not cfg.debug_hooks:
            raise APIError(400, "debug_forced_token_ids: only accepted by a server started with --debug-hooks",
                           "debug_forced_token_ids")

    def submit(prompts: list[list[int]], req: SamplingFields, max_tokens: int, prefix: str,
               logprobs: int | None = None, prompt_logprobs: int | None = None) -> tuple[str, Batch]:
        """One engine request per prompt and choice (choice i: vLLM's seed + i), indexed prompt x n + i, admitted
        or rejected as a whole; returns the API request's id and the batch of its engine requests."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        params = [req.sampling_params(max_tokens, logprobs, prompt_logprobs, seed) for seed in req.choice_seeds()]
        return rid, state["client"].submit([(prompt, p, f"{rid}-{j * req.n + i}")
                                            for j, prompt in enumerate(prompts) for i, p in enumerate(params)], rid)

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

    @app.get("/version")
    async def server_version():
        return {"version": version("hisparse")}

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any] = Body()):
        try:   # the chat form when the body has messages (vLLM's union), validated as the routes' bodies are
            req = (TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest).model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        check_model(req.model)
        def run() -> Response:
            tokens = chat_encoder.encode(req) if isinstance(req, TokenizeChatRequest) else \
                encode_text(req.prompt, req.add_special_tokens)
            strs = [text_tok.id_to_piece(t) for t in tokens] if req.return_token_strs else None
            return render({"count": len(tokens), "max_model_len": cfg.max_model_len, "tokens": tokens,
                           "token_strs": strs})
        return await offload(run)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < engine.vocab]
        if bad:
            raise APIError(400, f"tokens: ids {bad[:8]} outside the vocabulary [0, {engine.vocab})", "tokens")
        return await offload(lambda: render({"prompt": text_tok.decode(req.tokens)}))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_common(req, len(req.prompts), {"logprobs": req.logprobs, "prompt_logprobs": req.prompt_logprobs})
        prompts = await offload(lambda: [encode_text(p) if isinstance(p, str) else p for p in req.prompts])
        prompt_only = req.max_tokens == 0     # echo without generation: the prompt and its logprobs alone
        echo_logprobs = req.logprobs if req.echo and req.prompt_logprobs is None else req.prompt_logprobs
        rid, outputs = submit(prompts, req, 1 if prompt_only else req.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS,
                              "cmpl", None if prompt_only else req.logprobs, echo_logprobs)
        async with outputs.closed_on_error():   # until the response owns the batch
            texts = await offload(lambda: [p if isinstance(p, str) else text_tok.decode(ids)
                                           for p, ids in zip(req.prompts, prompts)])
        created = now()
        num = len(prompts) * req.n            # choices: prompt j's choice i has index j x n + i
        prompt_tokens = sum(map(len, prompts))
        lp_builders = [CompletionLogprobs(decode) for _ in range(num)]
        echoed, sent_ids = [False] * num, [False] * num

        def choice(i: int, out: RequestOutput, text: str, reason: str | None) -> dict:
            """A choice for `out` (text: its text); the first of each choice carries the echoed prompt."""
            prompt = prompts[i // req.n]
            ids, lps = ([], []) if prompt_only else (out.new_token_ids, out.logprobs)
            if req.echo and not echoed[i]:
                echoed[i] = True
                text = texts[i // req.n] + ("" if prompt_only else text)
                ids = prompt + ids
                lps = [None, *out.prompt_logprobs, *lps] if req.logprobs is not None else lps
            elif prompt_only:
                text = ""
            logprobs = lp_builders[i].chunk(ids, lps) if req.logprobs is not None else None
            out_choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
            if req.return_token_ids:
                out_choice["token_ids"] = [] if prompt_only else out.new_token_ids
                if not sent_ids[i]:
                    sent_ids[i], out_choice["prompt_token_ids"] = True, prompt
            return out_choice

        def body(choices: list[dict]) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": cfg.model_name,
                    "choices": choices}

        if req.stream:
            async def events():
                tokens, done = 0, 0
                async with aclosing(outputs) as stream:
                    async for i, out in stream:
                        if out.error:
                            yield sse(error_body(failed(out).message, "server_error", None, "internal_error"))
                            break
                        tokens += len(out.new_token_ids)
                        if out.text_delta or out.new_token_ids or out.finished:
                            yield await offload(lambda: sse(body([choice(i, out, out.text_delta, out.finish_reason
                                                                         if out.finished else None)])))
                        done += out.finished
                        if out.finished and req.include_usage and done == num:
                            yield sse({**body([]), "usage": Usage.of(prompt_tokens, tokens).model_dump()})
                yield sse("[DONE]")
            return BatchStream(events(), outputs)

        outs = [RequestOutput(rid, [], "") for _ in range(num)]   # each choice's outputs merged

        def each(i: int, out: RequestOutput) -> None:
            outs[i] = merge_outputs(outs[i], out)
        last = await collect(request, outputs, each)
        if last is None:
            return Response(status_code=CLIENT_CLOSED)
        if any(o.error for o in outs):
            raise failed(next(o for o in outs if o.error))

        def response() -> Response:
            choices = [choice(i, o, o.text_delta, o.finish_reason) for i, o in enumerate(outs)]
            if req.prompt_logprobs is not None:
                for c, o in zip(choices, outs):
                    c["prompt_logprobs"] = prompt_logprobs(o.prompt_logprobs, decode)
            completion = sum(o.output_tokens for o in outs)
            return render({**body(choices), "usage": Usage.of(prompt_tokens, completion).model_dump()})
        return await offload(response)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        check_common(req, 1, {"top_logprobs": req.top_logprobs, "prompt_logprobs": req.prompt_logprobs})
        prompt = await offload(chat_encoder.encode, req)
        max_tokens = req.max_completion_tokens or req.max_tokens or \
            max(1, min(CHAT_DEFAULT_MAX_TOKENS, cfg.max_model_len - len(prompt)))
        parsers = [OutputParser(markers, text_tok.decode, tuple(req.stop), req.min_tokens) for _ in range(req.n)]
        rid, outputs = submit([prompt], req, max_tokens, "chatcmpl", req.top_logprobs or 0 if req.logprobs else None,
                              req.prompt_logprobs)
        created = now()

        def reason_of(i: int, out: RequestOutput) -> str:
            return "tool_calls" if parsers[i].calls and out.finish_reason == "stop" else out.finish_reason

        def logprobs_of(lps: list) -> dict | None:
            return chat_logprobs(lps, decode) if req.logprobs else None

        def chunk(i: int, delta: dict, reason: str | None, lps: list | None = None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": cfg.model_name,
                    "choices": [{"index": i, "delta": delta, "logprobs": logprobs_of(lps) if lps else None,
                                 "finish_reason": reason}]}

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
                tokens, done, started = 0, 0, [False] * req.n
                async with aclosing(outputs) as stream:
                    async for i, out in stream:
                        if out.error:
                            yield sse(error_body(failed(out).message, "server_error", None, "internal_error"))
                            break
                        if not started[i]:    # with the first output, as vLLM (so a client's TTFT is real)
                            started[i] = True
                            yield sse(chunk(i, {"role": "assistant", "content": ""}, None))
                        tokens += len(out.new_token_ids)
                        d = parsers[i].push(out.new_token_ids)
                        if out.finished:
                            d = d.merge(parsers[i].finish())
                        if d or out.logprobs:
                            yield await offload(lambda: sse(chunk(i, delta_dict(d), None, out.logprobs)))
                        if out.finished:
                            done += 1
                            yield sse(chunk(i, {}, reason_of(i, out)))
                            if req.include_usage and done == req.n:
                                yield sse({**chunk(0, {}, None), "choices": [],
                                           "usage": Usage.of(out.prompt_tokens, tokens).model_dump()})
                yield sse("[DONE]")
            return BatchStream(events(), outputs)

        outs = [RequestOutput(rid, [], "") for _ in range(req.n)]   # each choice's outputs merged

        def each(i: int, out: RequestOutput) -> None:
            parsers[i].push(out.new_token_ids)
            outs[i] = merge_outputs(outs[i], out)
        last = await collect(request, outputs, each)
        if last is None:
            return Response(status_code=CLIENT_CLOSED)
        if any(o.error for o in outs):
            raise failed(next(o for o in outs if o.error))

        def response() -> Response:
            for p in parsers:
                p.finish()
            out = {"id": rid, "object": "chat.completion", "created": created, "model": cfg.model_name,
                   "choices": [{"index": i, "message": parsers[i].message(), "logprobs": logprobs_of(o.logprobs),
                                "finish_reason": reason_of(i, o)} for i, o in enumerate(outs)],
                   "usage": Usage.of(len(prompt), sum(o.output_tokens for o in outs)).model_dump()}
            if req.prompt_logprobs is not None:
                out["prompt_logprobs"] = prompt_logprobs(outs[0].prompt_logprobs, decode)
            return render(out)
        return await offload(response)

    return app
