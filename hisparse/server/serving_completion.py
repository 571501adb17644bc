"""/v1/completions: one or more prompts (text or token ids), n choices each, with echo, logprobs and vLLM's
prompt_logprobs, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from ..engine.request import RequestOutput
from .logprobs import CompletionLogprobs, prompt_logprobs
from .protocol import CompletionRequest, Usage
from .render import render, sse
from .serving_base import Generation, ServingBase

COMPLETION_DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions


class ServingCompletion(ServingBase):
    """The /v1/completions endpoint."""

    async def create(self, req: CompletionRequest, request: Request) -> Response:
        """Check, tokenize and submit the request's prompts x n choices, and answer with their completions."""
        self.check_common(req, len(req.prompts), {"logprobs": req.logprobs, "prompt_logprobs": req.prompt_logprobs})
        prompts = await self.offload(self._encode, req)
        prompt_only = req.max_tokens == 0     # echo without generation: the prompt and its logprobs alone
        echo_logprobs = req.logprobs if req.echo and req.prompt_logprobs is None else req.prompt_logprobs
        rid, outputs = self.submit(prompts, req, 1 if prompt_only else req.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS,
                                   "cmpl", None if prompt_only else req.logprobs, echo_logprobs)
        async with outputs.closed_on_error():   # until the response owns the batch
            texts = await self.offload(self._texts, req, prompts)
        return await Completion(self, req, rid, prompts, texts).respond(request, outputs)

    def _encode(self, req: CompletionRequest) -> list[list[int]]:
        return [self.codec.encode(p) if isinstance(p, str) else p for p in req.prompts]

    def _texts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """The prompts' texts, for echo (decoding a long token-id prompt costs more than a cached prefill)."""
        if not req.echo:
            return [""] * len(prompts)
        return [p if isinstance(p, str) else self.codec.text.decode(ids) for p, ids in zip(req.prompts, prompts)]


class Completion(Generation):
    """The choices of one /v1/completions request: prompt j's choice i has index j x n + i; the first chunk of
    each choice carries the echoed prompt (and with return_token_ids its prompt's ids)."""

    CHUNK = "text_completion"

    def __init__(self, serving: ServingCompletion, req: CompletionRequest, rid: str, prompts: list[list[int]],
                 texts: list[str]):
        super().__init__(serving, req, rid, len(prompts) * req.n)
        self.req: CompletionRequest = req
        self.prompts, self.texts = prompts, texts
        self.prompt_only = req.max_tokens == 0
        self.prompt_total = sum(map(len, prompts))
        self.lp_builders = [CompletionLogprobs(serving.codec.decode) for _ in range(self.num)]
        self.echoed, self.sent_ids = [False] * self.num, [False] * self.num

    def choice(self, i: int, out: RequestOutput, text: str, reason: str | None) -> dict:
        """A choice for `out` (text: its text); the first of each choice carries the echoed prompt."""
        req, prompt = self.req, self.prompts[i // self.req.n]
        ids, lps = ([], []) if self.prompt_only else (out.new_token_ids, out.logprobs)
        if req.echo and not self.echoed[i]:
            self.echoed[i] = True
            text = self.texts[i // req.n] + ("" if self.prompt_only else text)
            ids = prompt + ids
            lps = [None, *out.prompt_logprobs, *lps] if req.logprobs is not None else lps
        elif self.prompt_only:
            text = ""
        logprobs = self.lp_builders[i].chunk(ids, lps) if req.logprobs is not None else None
        out_choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if req.return_token_ids:
            out_choice["token_ids"] = [] if self.prompt_only else out.new_token_ids
            if not self.sent_ids[i]:
                self.sent_ids[i], out_choice["prompt_token_ids"] = True, prompt
        return out_choice

    def body(self, choices: list[dict]) -> dict:
        return {**self.head(self.CHUNK), "choices": choices}

    def prompt_tokens(self, out: RequestOutput) -> int:
        return self.prompt_total

    async def events(self, i: int, out: RequestOutput) -> AsyncIterator[str]:
        if out.text_delta or out.new_token_ids or out.finished:
            yield await self.serving.offload(self._chunk, i, out)

    def _chunk(self, i: int, out: RequestOutput) -> str:
        return sse(self.body([self.choice(i, out, out.text_delta, out.finish_reason if out.finished else None)]))

    def response(self, outs: list[RequestOutput]) -> Response:
        choices = [self.choice(i, o, o.text_delta, o.finish_reason) for i, o in enumerate(outs)]
        if self.req.prompt_logprobs is not None:
            for c, o in zip(choices, outs):
                c["prompt_logprobs"] = prompt_logprobs(o.prompt_logprobs, self.serving.codec.decode)
        completion = sum(o.output_tokens for o in outs)
        return render({**self.body(choices), "usage": Usage.of(self.prompt_total, completion).model_dump()})
