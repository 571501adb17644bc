"""/v1/chat/completions: messages (with tools and reasoning effort) through mistral-common's chat format, n choices
whose output is parsed into content, reasoning and tool calls, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import Response

from ..engine.request import RequestOutput, TokenLogprobs
from .config import ServerConfig
from .engine_client import AsyncEngine
from .logprobs import chat_logprobs, prompt_logprobs
from .output_parser import MarkerIds, OutputParser, ParsedDelta
from .protocol import ChatRequest, Usage
from .render import render, sse
from .serving_base import Generation, ServingBase, TextCodec

CHAT_DEFAULT_MAX_TOKENS = 1024         # chat has no OpenAI default; bounded so admission can reserve it


def delta_dict(d: ParsedDelta) -> dict:
    """A streamed chunk's `delta` with the parts `d` holds."""
    out = {}
    if d.reasoning:
        out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        out["tool_calls"] = d.tool_calls
    return out


class ServingChat(ServingBase):
    """The /v1/chat/completions endpoint."""

    def __init__(self, client: AsyncEngine, codec: TextCodec, cfg: ServerConfig, pool: ThreadPoolExecutor):
        super().__init__(client, codec, cfg, pool)
        self.markers = MarkerIds.of(codec.text.get_special_token)

    async def create(self, req: ChatRequest, request: Request) -> Response:
        """Check, format and submit the conversation's n choices, and answer with their messages."""
        self.check_common(req, 1, {"top_logprobs": req.top_logprobs, "prompt_logprobs": req.prompt_logprobs})
        prompt = await self.offload(self.codec.chat.encode, req)
        max_tokens = req.max_completion_tokens or req.max_tokens or \
            max(1, min(CHAT_DEFAULT_MAX_TOKENS, self.cfg.max_model_len - len(prompt)))
        parsers = [OutputParser(self.markers, self.codec.text.decode, tuple(req.stop), req.min_tokens)
                   for _ in range(req.n)]
        rid, outputs = self.submit([prompt], req, max_tokens, "chatcmpl",
                                   req.top_logprobs or 0 if req.logprobs else None, req.prompt_logprobs)
        return await ChatCompletion(self, req, rid, len(prompt), parsers).respond(request, outputs)


class ChatCompletion(Generation):
    """The choices of one /v1/chat/completions request, each with its output parser; a stream starts each choice
    with the assistant's role and ends it with a chunk holding its finish reason."""

    CHUNK = "chat.completion.chunk"

    def __init__(self, serving: ServingChat, req: ChatRequest, rid: str, prompt_len: int,
                 parsers: list[OutputParser]):
        super().__init__(serving, req, rid, req.n)
        self.req: ChatRequest = req
        self.prompt_len, self.parsers = prompt_len, parsers
        self.started = [False] * req.n

    def reason_of(self, i: int, out: RequestOutput) -> str:
        return "tool_calls" if self.parsers[i].calls and out.finish_reason == "stop" else out.finish_reason

    def logprobs_of(self, lps: list[TokenLogprobs]) -> dict | None:
        return chat_logprobs(lps, self.serving.codec.decode) if self.req.logprobs else None

    def chunk(self, i: int, delta: dict, reason: str | None, lps: list[TokenLogprobs] | None = None) -> dict:
        logprobs = self.logprobs_of(lps) if lps else None
        return {**self.head(self.CHUNK), "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                                      "finish_reason": reason}]}

    def prompt_tokens(self, out: RequestOutput) -> int:
        return out.prompt_tokens

    async def events(self, i: int, out: RequestOutput) -> AsyncIterator[str]:
        if not self.started[i]:    # with the first output, as vLLM (so a client's TTFT is real)
            self.started[i] = True
            yield sse(self.chunk(i, {"role": "assistant", "content": ""}, None))
        d = self.parsers[i].push(out.new_token_ids)
        if out.finished:
            d = d.merge(self.parsers[i].finish())
        if d or out.logprobs:
            yield await self.serving.offload(self._delta, i, d, out.logprobs)
        if out.finished:
            yield sse(self.chunk(i, {}, self.reason_of(i, out)))

    def _delta(self, i: int, d: ParsedDelta, lps: list[TokenLogprobs]) -> str:
        return sse(self.chunk(i, delta_dict(d), None, lps))

    def each(self, i: int, out: RequestOutput) -> None:
        self.parsers[i].push(out.new_token_ids)

    def response(self, outs: list[RequestOutput]) -> Response:
        for p in self.parsers:
            p.finish()
        out = {**self.head("chat.completion"),
               "choices": [{"index": i, "message": self.parsers[i].message(), "logprobs": self.logprobs_of(o.logprobs),
                            "finish_reason": self.reason_of(i, o)} for i, o in enumerate(outs)],
               "usage": Usage.of(self.prompt_len, sum(o.output_tokens for o in outs)).model_dump()}
        if self.req.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs(outs[0].prompt_logprobs, self.serving.codec.decode)
        return render(out)
