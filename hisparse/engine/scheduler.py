"""Continuous batching: FIFO admission by KV capacity, then per step every decode plus chunked prefill.

A request reserves in the KV store what it needs now: its known tokens plus this step's drafts (the store rounds
up to whole pages), and grows the reservation as it decodes. When the store cannot grow a running request, the
newest running request is preempted (vLLM's recompute policy): its KV is freed, it goes back to the head of the
queue and, once readmitted, prefills its prompt and the tokens it already generated again, then continues; its
client sees nothing but a pause. So a long max_tokens never holds room it does not use, and the oldest requests
always make progress. The head of the queue is admitted once its tokens fit (FIFO, so a long request is not
starved by short ones); a request that could never fit is rejected at submission. With prefix caching a request is
admitted from its longest cached page-aligned prefix (`LatentKV.admit`) and prefills only the rest. Each step takes one token for
every decoding request and spends the rest of the token budget on draft tokens (with speculative decoding: a
decoding request's segment becomes [anchor, d_1..d_n]) and then on prefill chunks, oldest request first.

With `fair_prefill_tokens` (hisparse serve's default) the prefill part is shared between groups (the requests of
one API request: its prompts x n) instead: while more than one group runs, a step spends at most that many budget
tokens on prefill, so every decoding request's time per token stays near a light step's; each group in turn,
starting one group later every step, gets an equal part of what is left, and a prompt token whose logprobs are
asked counts as 1 + PROMPT_LOGPROB_ROW_COST tokens. A request with a long prompt, prompt logprobs or a large fan-out
thus pays for them with its own share, never with its neighbours' time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..core.batch import Segment
from ..kv.base import LatentKV
from .request import Request, RequestError, Status
from .runner import ScheduledStep

PROMPT_LOGPROB_ROW_COST = 32   # budget tokens a prompt-logprob row adds: the vocabulary's LM head, log-softmax and
                               # top-k for one row (on the CPU tiny model about 65 prefill tokens' time)


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 64              # requests running at once
    max_num_batched_tokens: int = 512   # tokens per forward (decode tokens + prefill chunks)
    fair_prefill_tokens: int = 0        # prefill budget per step while several groups run, shared (0: FIFO)

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
                 on_preempt: Callable[[Request], None] = lambda req: None, recompute_tail: int = 1):
        self.cfg, self.kv, self.num_speculative_tokens = cfg, kv, num_speculative_tokens
        self.recompute_tail = max(1, recompute_tail)   # known tokens a prefix-cache hit still computes
        self.on_preempt = on_preempt      # told after a request's KV is freed by a preemption
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._turn = 0     # rotates which group's prefill goes first (fair sharing)

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

    def reusable(self, req: Request) -> list[int]:
        """The tokens whose cached rows req may start from: none while its prompt logprobs are asked (every prompt
        row's logits), else all but its last `recompute_tail` known tokens (the last one's logits give the next
        token; a drafter's window needs the forward's hidden states of the rows it reads)."""
        if not self.kv.prefix_caching or req.wants_prompt_logits:
            return []
        return req.token_slice(0, max(0, req.total_len - self.recompute_tail))

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            matched = self.kv.admit(req.id, self.needed(req), self.reusable(req))
            if matched is None:
                break
            req.num_computed = matched
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
        if self.cfg.fair_prefill_tokens:
            if len({r.group for r in self.running}) > 1:
                budget = min(budget, self.cfg.fair_prefill_tokens)
            self.share_prefill(step, prefill, budget)
            return step if step.reqs else None
        for req in prefill:
            n = min(req.total_len - req.num_computed, budget)
            if n <= 0:
                break
            step.add(req, Segment(req.id, req.num_computed, n))
            budget -= n
        return step if step.reqs else None

    def share_prefill(self, step: ScheduledStep, prefill: list[Request], budget: int) -> None:
        """Prefill chunks within `budget`, shared between groups: the groups in turn (starting one later every
        step) each get an equal part of what is left, spent on their requests oldest first; the first group of
        the step gets at least one token, so every group progresses whatever the costs."""
        groups: dict[str, list[Request]] = {}
        for req in prefill:
            groups.setdefault(req.group, []).append(req)
        order = list(groups)
        if not order:
            return
        first = self._turn % len(order)
        self._turn += 1
        order = order[first:] + order[:first]
        for k, group in enumerate(order):
            share = budget // (len(order) - k)
            spent = 0
            for req in groups[group]:
                cost = 1 + (PROMPT_LOGPROB_ROW_COST if req.wants_prompt_logits else 0)
                n = min(req.total_len - req.num_computed, (share - spent) // cost)
                if n <= 0 and k == 0 and spent == 0:
                    n = 1
                if n <= 0:
                    break
                step.add(req, Segment(req.id, req.num_computed, n))
                spent += n * cost
            budget = max(0, budget - spent)
