"""What the endpoints share: the checks every request passes, the submission of its engine requests, the worker
pool for CPU-heavy work, token text, and `Generation`, which turns a request's outputs into a streamed or a whole
response (the one place that collects a non-streaming request's outputs)."""

from __future__ import annotations

import asyncio
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, suppress
from functools import lru_cache, partial
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from starlette.types import Receive, Scope, Send

from ..engine.request import RequestOutput
from .chat import ChatEncoder
from .config import ServerConfig
from .engine_client import AsyncEngine, Batch, merge_outputs
from .errors import APIError, error_body
from .protocol import SamplingFields, Usage, now
from .render import sse

DISCONNECT_POLL_S = 0.25               # how often a non-streaming request checks that its client is still there
CLIENT_CLOSED = 499                    # the status of a response nobody is left to read (nginx's convention)


def failed(out: RequestOutput) -> APIError:
    """The error answered for an engine request that failed."""
    return APIError(500, f"generation failed: {out.error}", code="internal_error", kind="server_error")


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


async def _consume(outputs: Batch, outs: list[RequestOutput], each: Callable[[int, RequestOutput], None]) -> None:
    async with aclosing(outputs) as stream:
        async for i, out in stream:
            each(i, out)
            outs[i] = merge_outputs(outs[i], out)


async def collect(request: Request, outputs: Batch, outs: list[RequestOutput],
                  each: Callable[[int, RequestOutput], None]) -> list[RequestOutput] | None:
    """Consume a non-streaming request's outputs (choice index, output), passing each to `each` and merging it
    into `outs[index]`; returns `outs`, or None if the client disconnected first. Then the outputs are closed,
    which aborts the requests in the engine, as a dropped stream does: a client that gives up on a long prompt
    does not leave the server prefilling it for nobody (and a graceful shutdown does not wait for it)."""
    task = asyncio.ensure_future(_consume(outputs, outs, each))
    while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            return None
    task.result()
    return outs


class TextCodec:
    """Text <-> token ids with the checkpoint's tokenizer (`chat`: a chat request's prompt ids); single-token
    texts (every logprob entry) are cached."""

    def __init__(self, tokenizer: MistralTokenizer):
        self.text = tokenizer.instruct_tokenizer.tokenizer
        self.chat = ChatEncoder(tokenizer)
        self.piece = lru_cache(maxsize=None)(self._piece)

    def _piece(self, tid: int) -> str:
        return self.text.decode([tid])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids; text the tokenizer cannot take (its regex gives up on some pathological inputs, such as
        a very long run of whitespace) is the client's problem: a 400 naming the prompt."""
        try:
            return self.text.encode(text, add_special_tokens, False)
        except Exception as e:   # noqa: BLE001 - whatever the tokenizer raises is about this text
            raise APIError(400, f"prompt: the tokenizer cannot encode this text ({type(e).__name__}: {e})",
                           "prompt") from None

    def decode(self, ids: list[int]) -> str:
        """Text of ids; single tokens come from the cache."""
        return self.piece(ids[0]) if len(ids) == 1 else self.text.decode(ids)


class ServingBase:
    """The base of the endpoints' classes (vLLM's OpenAIServing): the engine client, token text, the server's
    limits and the worker pool, shared by all of them."""

    def __init__(self, client: AsyncEngine, codec: TextCodec, cfg: ServerConfig, pool: ThreadPoolExecutor):
        self.client, self.engine, self.codec, self.cfg, self.pool = client, client.engine, codec, cfg, pool

    async def offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in the bounded worker pool: tokenizing, detokenizing, formatting logprobs and rendering a
        request's JSON take time in proportion to what the request carries, and the event loop (/health, every
        other client) must not wait for it."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, partial(fn, *args))

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is the served one (no model named: the one served)."""
        if model and model != self.cfg.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.cfg.model_name}`.",
                           "model", "model_not_found")

    def check_common(self, req: SamplingFields, prompts: int, logprobs: dict[str, int | None]) -> None:
        """The checks every generation request passes before anything is tokenized or queued: the model, the
        fan-out (`prompts` x n engine requests), logit_bias entries and logprobs counts (`logprobs`: field ->
        value) within the server's limits."""
        cfg = self.cfg
        self.check_model(req.model)
        if prompts * req.n > cfg.max_batch_fanout:
            raise APIError(400, f"n: {prompts} prompt(s) x n={req.n} is {prompts * req.n} engine requests; this "
                                f"server accepts at most {cfg.max_batch_fanout} per request (--max-batch-fanout)",
                           "n", "fanout_too_large")
        if req.logit_bias and len(req.logit_bias) > cfg.max_logit_bias:
            raise APIError(400, f"logit_bias: {len(req.logit_bias)} entries; this server accepts at most "
                                f"{cfg.max_logit_bias} (--max-logit-bias)", "logit_bias")
        limit = min(cfg.max_logprobs, self.engine.vocab)
        for name, n in logprobs.items():
            if n is not None and n > limit:
                raise APIError(400, f"{name}: {n} alternatives per token; this server returns at most {limit} "
                                    "(--max-logprobs)", name)
        if req.debug_forced_token_ids is not None and not cfg.debug_hooks:
            raise APIError(400, "debug_forced_token_ids: only accepted by a server started with --debug-hooks",
                           "debug_forced_token_ids")

    def submit(self, prompts: list[list[int]], req: SamplingFields, max_tokens: int, prefix: str,
               logprobs: int | None = None, prompt_logprobs: int | None = None) -> tuple[str, Batch]:
        """One engine request per prompt and choice (choice i: vLLM's seed + i), indexed prompt x n + i, admitted
        or rejected as a whole; returns the API request's id and the batch of its engine requests."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        params = [req.sampling_params(max_tokens, logprobs, prompt_logprobs, seed) for seed in req.choice_seeds()]
        return rid, self.client.submit([(prompt, p, f"{rid}-{j * req.n + i}")
                                        for j, prompt in enumerate(prompts) for i, p in enumerate(params)], rid)


class Generation(ABC):
    """One API request's choices as they run (`num` of them, index prompt x n + i), subclassed per endpoint: the
    subclass says what one output streams (`events`), what it sees of each output of a non-streaming request
    (`each`) and how the merged outputs render (`response`, in the worker pool); this class streams, or collects
    and answers."""

    CHUNK: ClassVar[str]   # the `object` of a streamed chunk

    def __init__(self, serving: ServingBase, req: SamplingFields, rid: str, num: int):
        self.serving, self.req, self.rid, self.num = serving, req, rid, num
        self.created = now()
        self.tokens = 0   # output tokens streamed so far
        self.done = 0     # choices finished so far (streaming)

    def head(self, obj: str) -> dict:
        """The fields every response and chunk of this request starts with; `obj` its `object`."""
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.serving.cfg.model_name}

    @abstractmethod
    def events(self, i: int, out: RequestOutput) -> AsyncIterator[str]:
        """The SSE events that output `out` of choice i streams (an async generator)."""

    @abstractmethod
    def prompt_tokens(self, out: RequestOutput) -> int:
        """The prompt tokens the streamed usage counts, once `out` finished the last choice."""

    def each(self, i: int, out: RequestOutput) -> None:
        """Sees every output of a non-streaming request as it arrives; nothing by default."""

    @abstractmethod
    def response(self, outs: list[RequestOutput]) -> Response:
        """The non-streaming response from each choice's merged outputs."""

    async def respond(self, request: Request, outputs: Batch) -> Response:
        """The response to the request whose engine requests are `outputs`: streamed, or whole once they finish."""
        if self.req.stream:
            return BatchStream(self.stream(outputs), outputs)
        return await self.full(request, outputs)

    async def stream(self, outputs: Batch) -> AsyncIterator[str]:
        """Each output's events, the usage (stream_options.include_usage) once every choice finished, then [DONE];
        a failed engine request ends the stream with an error event."""
        async with aclosing(outputs) as stream:
            async for i, out in stream:
                if out.error:
                    yield sse(error_body(failed(out).message, "server_error", None, "internal_error"))
                    break
                self.tokens += len(out.new_token_ids)
                self.done += out.finished
                async for event in self.events(i, out):
                    yield event
                if out.finished and self.req.include_usage and self.done == self.num:
                    usage = Usage.of(self.prompt_tokens(out), self.tokens).model_dump()
                    yield sse({**self.head(self.CHUNK), "choices": [], "usage": usage})
        yield sse("[DONE]")

    async def full(self, request: Request, outputs: Batch) -> Response:
        """The whole response once every choice finished (499 if the client left first, 500 if one failed)."""
        outs = await collect(request, outputs, [RequestOutput(self.rid, [], "") for _ in range(self.num)], self.each)
        if outs is None:
            return Response(status_code=CLIENT_CLOSED)
        if any(o.error for o in outs):
            raise failed(next(o for o in outs if o.error))
        return await self.serving.offload(self.response, outs)
