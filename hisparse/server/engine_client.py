"""The asyncio side of the engine: submit from the event loop, receive outputs through an asyncio.Queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from ..engine.engine import Engine
from ..engine.request import RequestOutput, SamplingParams


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (the consumer fell behind the engine)."""
    return RequestOutput(a.request_id, a.new_token_ids + b.new_token_ids, a.text_delta + b.text_delta,
                         b.finished, b.finish_reason, b.error, b.prompt_tokens, b.output_tokens,
                         a.logprobs + b.logprobs, a.prompt_logprobs + b.prompt_logprobs)


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several requests (the choices of one API request) as they come, tagged with their index.
    Closing it closes every stream, which aborts the requests that have not finished."""
    q: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        async with aclosing(stream) as outs:
            async for out in outs:
                q.put_nowait((i, out))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, out = await q.get()
            left -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class AsyncEngine:
    """Owns the engine thread. `submit` queues a request (raising RequestError at once if it can never run) and
    returns an async generator of its outputs that aborts the request if it is closed before the end."""

    def __init__(self, engine: Engine):
        self.engine = engine
        engine.start()

    def submit(self, prompt: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:   # engine thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(q.put_nowait, out)

        self.engine.add_request(prompt, params, request_id, sink)
        return self._outputs(q, request_id)

    async def _outputs(self, q: asyncio.Queue, request_id: str) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await q.get()
                while not out.finished and not q.empty():
                    out = merge_outputs(out, q.get_nowait())
                finished = out.finished
                yield out
        finally:
            if not finished:   # client went away (disconnect or cancellation): free the request now
                self.engine.abort(request_id)

    def shutdown(self) -> None:
        self.engine.stop()
