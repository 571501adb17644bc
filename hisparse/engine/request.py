"""One generation request as the engine tracks it: its tokens, sampling settings and lifecycle."""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20   # the most alternatives per token a request may ask for (vLLM's default max_logprobs)


class RequestError(ValueError):
    """A request the engine cannot run; `field` names the offending setting, `status` the HTTP code to answer."""

    def __init__(self, message: str, field: str | None = None, status: int = 400):
        super().__init__(message)
        self.field, self.status = field, status


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI names). temperature 0 = greedy; top_k 0 or -1 = off."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    forced_token_ids: tuple[int, ...] = ()   # debug hook: the first outputs are these ids (parser tests)
    # vLLM's extensions (its semantics and ranges; sampling.py applies them)
    repetition_penalty: float = 1.0          # > 0; 1 = off
    presence_penalty: float = 0.0            # [-2, 2]
    frequency_penalty: float = 0.0           # [-2, 2]
    min_p: float = 0.0                       # [0, 1]
    min_tokens: int = 0                      # stop ids and EOS are masked until this many outputs
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs added to the logits
    logprobs: int | None = None              # top alternatives per output token (0: the token's own only)
    prompt_logprobs: int | None = None       # the same for every prompt token after the first

    @property
    def penalized(self) -> bool:
        """Any processor that changes the logits before sampling (min_tokens, logit_bias, penalties)."""
        return bool(self.min_tokens or self.logit_bias or self.repetition_penalty != 1.0
                    or self.presence_penalty or self.frequency_penalty)

    @property
    def plain(self) -> bool:
        """Neither processors, min_p nor logprobs: the request can take the sampler's fast path or drafts."""
        return not (self.penalized or self.min_p or self.logprobs is not None or self.prompt_logprobs is not None)

    def validate(self, vocab_size: int) -> None:
        """Raise RequestError naming the first out-of-range field."""
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise RequestError(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}", "top_k")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise RequestError(f"seed must be in [0, 2**64), got {self.seed}", "seed")
        if any(not s for s in self.stop):
            raise RequestError("stop: stop strings must be non-empty", "stop")
        for name in ("stop_token_ids", "forced_token_ids"):
            bad = [t for t in getattr(self, name) if not 0 <= t < vocab_size]
            if bad:
                raise RequestError(f"{name}: ids {bad} outside the vocabulary [0, {vocab_size})", name)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise RequestError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}",
                               "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
                               "min_tokens")
        bad = [t for t, _ in self.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"logit_bias: token ids {bad[:8]} outside the vocabulary [0, {vocab_size})",
                               "logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= vocab_size:
                raise RequestError(f"{name} must be in [0, {vocab_size}] (the vocabulary), got {n}", name)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What the engine reports after a step for one request (delivered to the request's sink)."""
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: str | None = None    # "stop" | "length" | "abort" | "error"
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    logprobs: list["TokenLogprobs"] = field(default_factory=list)          # per new token (when asked)
    prompt_logprobs: list["TokenLogprobs"] = field(default_factory=list)   # prompt tokens 1.. (first output only)


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log-probabilities: the chosen token's, its rank (1 = most likely) and the top-k."""
    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(eq=False)
class Request:
    """Engine-side state. `num_computed` tokens of prompt + output have their KV written."""
    id: str
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[RequestOutput], None] = lambda out: None
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.monotonic)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)   # prompt tokens 1.. computed so far
    group: str = ""     # the API request this one belongs to (its prompts x n share one), for fair scheduling
    _prompt_mask: torch.Tensor | None = None

    def prompt_mask(self, vocab: int) -> torch.Tensor:
        """[V] bool: the token ids of the prompt (computed once; the repetition penalty's prompt half)."""
        if self._prompt_mask is None:
            self._prompt_mask = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(self.prompt), True)
        return self._prompt_mask
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def total_len(self) -> int:
        """Tokens whose ids are known (prompt + sampled)."""
        return len(self.prompt) + len(self.output)

    @property
    def max_len(self) -> int:
        """Positions the request may ever occupy (prompt + max_tokens)."""
        return len(self.prompt) + self.params.max_tokens

    def num_drafts(self, limit: int) -> int:
        """Drafts a speculative step of this decoding request may verify: at most `limit`, none while forced ids
        remain (the debug hook fixes those outputs), and at most what the step could still emit before
        max_tokens (accepted drafts + 1), so every draft position stays inside the request's reservation. A
        request with logits processors, min_p or logprobs decodes one token per step (the plain sampler)."""
        if len(self.output) < len(self.params.forced_token_ids) or not self.params.plain:
            return 0
        return max(0, min(limit, self.params.max_tokens - len(self.output) - 1))

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether its prefill still returns every row's logits (prompt logprobs asked and not all computed)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt) - 1

    def token_slice(self, start: int, n: int) -> list[int]:
        """Token ids at positions [start, start + n) of prompt + output (no copy of the whole sequence)."""
        p = len(self.prompt)
        return self.prompt[start:start + n] + self.output[max(0, start - p):max(0, start + n - p)]
