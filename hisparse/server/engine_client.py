"""The asyncio side of the engine: submit an API request's engine requests from the event loop as one batch and
receive their outputs on the loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ..engine.engine import Engine
from ..engine.request import RequestOutput, SamplingParams


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (the consumer fell behind the engine)."""
    return RequestOutput(a.request_id, a.new_token_ids + b.new_token_ids, a.text_delta + b.text_delta,
                         b.finished, b.finish_reason, b.error, b.prompt_tokens, b.output_tokens,
                         a.logprobs + b.logprobs, a.prompt_logprobs + b.prompt_logprobs)


class Batch:
    """The engine requests of one API request (its prompts x choices). Iterating yields (index, output) as outputs
    arrive, a request's outputs merged while the consumer is behind. `aclose` aborts every request that has not
    finished, whether or not iteration ever started, so whoever owns the batch can always release it."""

    def __init__(self, engine: Engine, ids: list[str]):
        self.engine, self.ids = engine, ids
        self.unfinished = set(range(len(ids)))
        self.pending: dict[int, RequestOutput] = {}   # per index, in arrival order
        self.ready = asyncio.Event()

    def put(self, i: int, out: RequestOutput) -> None:
        """Called on the event loop for every output of request i."""
        self.pending[i] = merge_outputs(self.pending[i], out) if i in self.pending else out
        self.ready.set()

    def __aiter__(self) -> "Batch":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while not self.pending:
            if not self.unfinished:
                raise StopAsyncIteration
            self.ready.clear()
            await self.ready.wait()
        i = next(iter(self.pending))
        out = self.pending.pop(i)
        if out.finished:
            self.unfinished.discard(i)
        return i, out

    @asynccontextmanager
    async def closed_on_error(self) -> AsyncIterator[None]:
        """Close the batch if the block raises (or is cancelled): work between submitting and handing the batch
        to a response never leaves requests running."""
        try:
            yield
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Abort every request of the batch that has not finished (the client went away, or the request
        failed)."""
        for i in sorted(self.unfinished):
            self.engine.abort(self.ids[i])
        self.unfinished.clear()
        self.pending.clear()


class AsyncEngine:
    """Owns the engine thread. `submit` queues an API request's engine requests as a whole (raising RequestError
    at once, and queueing none, if any of them can never run)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        engine.start()

    def submit(self, requests: list[tuple[list[int], SamplingParams, str]], group: str) -> Batch:
        """Queue (prompt, params, request id) x k atomically, as one scheduling `group`; their outputs come
        through the returned Batch."""
        loop = asyncio.get_running_loop()
        batch = Batch(self.engine, [rid for _, _, rid in requests])

        def sink(i: int):
            def put(out: RequestOutput) -> None:   # engine thread
                if not loop.is_closed():
                    loop.call_soon_threadsafe(batch.put, i, out)
            return put

        self.engine.add_requests([(prompt, params, rid, sink(i)) for i, (prompt, params, rid) in enumerate(requests)],
                                 group)
        return batch

    def shutdown(self) -> None:
        self.engine.stop()
