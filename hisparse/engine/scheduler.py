"""Continuous batching: FIFO admission by KV capacity, then per step every decode plus chunked prefill.

A request reserves in the KV store what it needs now: its known tokens plus this step's drafts (the store rounds
up to whole pages), and grows the reservation as it decodes. When the store cannot grow a running request, the
newest running request is preempted (vLLM's recompute policy): its KV is freed, it goes back to the head of the
queue and, once readmitted, prefills its prompt and the tokens it already generated again, then continues; its
client sees nothing but a pause. So a long max_tokens never holds room it does not use, and the oldest requests
always make progress. The head of the queue is admitted once its tokens fit (FIFO, so a long request is not
starved by short ones); a request that could never fit is rejected at submission. Each step takes one token for
every decoding request and spends the rest of the token budget on draft tokens (with speculative decoding: a
decoding request's segment becomes [anchor, d_1..d_n]) and then on prefill chunks, oldest request first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..model.batch import Segment
from ..model.kv import LatentKV
from .request import Request, RequestError, Status
from .runner import ScheduledStep


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 64              # requests running at once
    max_num_batched_tokens: int = 512   # tokens per forward (decode tokens + prefill chunks)

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}) so every running request decodes each step")


class Scheduler:
    """`num_speculative_tokens`: drafts each decoding request may verify per step (0: no speculation). When the
    token budget cannot hold every decode's drafts, later requests get fewer (`hisparse serve` sizes the budget
    to max_num_seqs x (1 + N), so a request's drafts never depend on its neighbours)."""

    def __init__(self, cfg: SchedulerConfig, kv: LatentKV, num_speculative_tokens: int = 0,
                 on_preempt: Callable[[Request], None] = lambda req: None):
        self.cfg, self.kv, self.num_speculative_tokens = cfg, kv, num_speculative_tokens
        self.on_preempt = on_preempt      # told after a request's KV is freed by a preemption
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def check(self, req: Request) -> None:
        """Reject a request that can never run (too long for the model or for the whole KV store)."""
        n, p = req.max_len, len(req.prompt)
        if p >= self.cfg.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.cfg.max_model_len} tokens. However, the prompt alone "
                f"has {p} tokens, which leaves no room for a completion. Please reduce the length of the prompt.",
                "prompt")
        if n > self.cfg.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.cfg.max_model_len} tokens. However, you requested "
                f"{n} tokens ({p} in the prompt, {req.params.max_tokens} in the completion). Please reduce the "
                "length of the prompt or max_tokens.", "max_tokens")
        if not self.kv.can_ever_admit(n):
            raise RequestError(
                f"This request needs {n} tokens of KV ({p} prompt + {req.params.max_tokens} max_tokens) but the "
                f"KV store holds at most {self.kv.token_capacity()} tokens.", "max_tokens")

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and free everything it holds in the KV store."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.release(req.id)
        req.status = Status.FINISHED

    def needed(self, req: Request) -> int:
        """Positions req may write in its next step: its known tokens plus drafts (never beyond max_len)."""
        return min(req.max_len, req.total_len + self.num_speculative_tokens)

    def preempt(self, req: Request) -> None:
        """Free a running request's KV and put it back at the head of the queue, to recompute what it had."""
        self.running.remove(req)
        self.kv.release(req.id)
        req.num_computed = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        self.on_preempt(req)

    def grow(self) -> None:
        """Give every running request, oldest first, the room of its next step; when the store is full, preempt
        the newest running request (possibly the one growing) until it fits."""
        for req in list(self.running):
            while req in self.running and not self.kv.reserve(req.id, self.needed(req)):
                self.preempt(self.running[-1])

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if not self.kv.reserve(req.id, self.needed(req)):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)

    def schedule(self) -> ScheduledStep | None:
        """The next forward, or None when nothing can run."""
        self.grow()
        self.admit()
        decode = [r for r in self.running if r.total_len - r.num_computed == 1]
        prefill = [r for r in self.running if r.total_len - r.num_computed > 1]
        budget = self.cfg.max_num_batched_tokens - len(decode)   # >= 0: max_num_batched_tokens >= max_num_seqs
        step = ScheduledStep()
        for req in decode:
            n = min(req.num_drafts(self.num_speculative_tokens), budget)
            step.add(req, Segment(req.id, req.num_computed, 1 + n), n)
            budget -= n
        for req in prefill:
            n = min(req.total_len - req.num_computed, budget)
            if n <= 0:
                break
            step.add(req, Segment(req.id, req.num_computed, n))
            budget -= n
        return step if step.reqs else None
