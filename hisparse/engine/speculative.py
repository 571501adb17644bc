"""Lossless speculative decoding (spec §5.3, §6) for one request: draft N tokens, verify [anchor, d_1..d_N] at
positions P..P+N in one target forward, accept a prefix, emit one correction/bonus token, roll back the rest.

Greedy requests (temperature 0) accept the longest prefix of drafts equal to the target's argmax, so the output
is exactly plain greedy decoding. Sampled requests use standard rejection sampling against the distribution each
draft was drawn from (`draft_sample_method` 'greedy': a point mass; 'probabilistic': the drafter's processed
softmax), so the emitted tokens are distributed exactly as sampling from the target. The verify forward's taps
feed the drafter's context path for the accepted positions; rejected positions are dropped from the target's
LatentKV (`truncate`) and from the draft window.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..core.batch import ForwardTrace, Segment
from ..core.config import ModelConfig
from ..model.dspark import DraftSampler
from ..kv.base import LatentKV
from ..model.ml4 import ML4
from .request import SamplingParams
from .sampling import filter_top_k_top_p

GREEDY = SamplingParams(temperature=0.0)
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` (the JSON `vllm serve` takes): {"method": "dspark", "num_speculative_tokens": 3}."""
    method: str = "dspark"
    num_speculative_tokens: int = 3
    draft_sample_method: str = "greedy"

    @classmethod
    def parse(cls, spec: str | dict[str, Any], cfg: ModelConfig) -> "SpeculativeConfig":
        """Validate against the model's drafter; errors name the offending field."""
        try:
            d = json.loads(spec) if isinstance(spec, str) else dict(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; "
                             f"known: {sorted(cls.__dataclass_fields__)}")
        if d.get("method", "dspark") != "dspark":
            raise ValueError(f"speculative_config.method: {d['method']!r} is not supported (only 'dspark')")
        if cfg.mtp is None:
            raise ValueError("speculative_config.method: 'dspark' needs a checkpoint with a drafter "
                             "(params.json has no 'mtp' block)")
        n = d.get("num_speculative_tokens", cfg.mtp.block_size)
        if not isinstance(n, int) or not 1 <= n <= cfg.mtp.block_size:
            raise ValueError(f"speculative_config.num_speculative_tokens: {n!r}, must be an int in "
                             f"1..{cfg.mtp.block_size} (the drafter's block_size)")
        method = d.get("draft_sample_method", "greedy")
        if method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"speculative_config.draft_sample_method: {method!r}, choose one of "
                             f"{list(DRAFT_SAMPLE_METHODS)}")
        return cls("dspark", n, method)

    @staticmethod
    def rows_per_request(spec: "SpeculativeConfig | None") -> int:
        """Rows one running request adds to a decode step: its token, and its drafts under speculation."""
        return 1 + (spec.num_speculative_tokens if spec is not None else 0)


class Proposer(Protocol):
    """What the decoders need from a drafter (DSparkDrafter, OracleProposer). The engine uses the batch forms."""
    tap_layers: tuple[int, ...]

    def observe(self, req: Hashable, taps: dict[int, torch.Tensor], positions: torch.Tensor) -> None: ...

    def observe_batch(self, reqs: list[Hashable], taps: dict[int, torch.Tensor], positions: torch.Tensor,
                      counts: list[int]) -> None: ...

    def propose(self, req: Hashable, anchor: int, pos: int, n: int, sample: DraftSampler
                ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def propose_batch(self, reqs: list[Hashable], anchors: torch.Tensor, pos: torch.Tensor, n: int,
                      sample: DraftSampler) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def truncate(self, req: Hashable, length: int) -> None: ...

    def release(self, req: Hashable) -> None: ...


class OracleProposer:
    """Proposes a known continuation (e.g. the target's own greedy tokens), so greedy verification accepts every
    draft: the upper bound of speculative decoding. `sequence`: one token list for every request, or a list per
    request id. `shadow` (a real drafter) is run alongside and its proposals discarded, to measure the drafting
    cost at oracle acceptance."""

    def __init__(self, sequence: list[int] | dict[Hashable, list[int]], shadow: Proposer | None = None):
        self.sequence, self.shadow = sequence, shadow
        self.tap_layers = shadow.tap_layers if shadow is not None else ()

    def _known(self, req: Hashable, pos: int, n: int) -> list[int]:
        seq = self.sequence.get(req, []) if isinstance(self.sequence, dict) else self.sequence
        known = seq[pos + 1: pos + 1 + n]
        return known + [0] * (n - len(known))

    def observe(self, req: Hashable, taps: dict[int, torch.Tensor], positions: torch.Tensor) -> None:
        if self.shadow is not None:
            self.shadow.observe(req, taps, positions)

    def observe_batch(self, reqs: list[Hashable], taps: dict[int, torch.Tensor], positions: torch.Tensor,
                      counts: list[int]) -> None:
        if self.shadow is not None:
            self.shadow.observe_batch(reqs, taps, positions, counts)

    def propose(self, req: Hashable, anchor: int, pos: int, n: int, sample: DraftSampler
                ) -> tuple[torch.Tensor, None]:
        if self.shadow is not None:
            self.shadow.propose(req, anchor, pos, n, sample)
        return torch.tensor(self._known(req, pos, n)), None

    def propose_batch(self, reqs: list[Hashable], anchors: torch.Tensor, pos: torch.Tensor, n: int,
                      sample: DraftSampler) -> tuple[torch.Tensor, None]:
        if self.shadow is not None:
            self.shadow.propose_batch(reqs, anchors, pos, n, sample)
        return torch.tensor([self._known(r, p, n) for r, p in zip(reqs, pos.tolist())]), None

    def truncate(self, req: Hashable, length: int) -> None:
        if self.shadow is not None:
            self.shadow.truncate(req, length)

    def release(self, req: Hashable) -> None:
        if self.shadow is not None:
            self.shadow.release(req)


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """pi = softmax(proc(logits)) per row under that row's temperature (> 0), top-k and top-p: [B, V] -> [B, V]."""
    B, vocab = logits.shape
    dev = logits.device
    z = logits / torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)[:, None]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)
    if bool((top_k < vocab).any() or (top_p < 1).any()):
        z = filter_top_k_top_p(z, top_k, top_p)
    return torch.softmax(z, dim=-1)


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """pi = softmax(proc(logits)): temperature, then top-k / top-p. logits [n, V] -> probs [n, V]."""
    return processed_probs(logits, [params] * logits.shape[0])


def draft_sampler(method: str, params: SamplingParams, generator: torch.Generator | None) -> DraftSampler:
    """How the drafter picks each draft: argmax (q = point mass, returned as None), or a sample from
    q = softmax(proc(logits)) under the request's own settings."""
    return batch_draft_sampler(method, [params], [generator])


def batch_draft_sampler(method: str, params: list[SamplingParams], generators: list[torch.Generator | None]
                        ) -> DraftSampler:
    """draft_sampler for B requests drafted together (row b: params[b], generators[b]). Argmax unless the method
    is 'probabilistic' and every row samples (temperature > 0); callers group rows so that this holds."""
    if method == "greedy" or all(p.temperature == 0 for p in params):
        return lambda logits: (logits.argmax(-1), None)
    if any(p.temperature == 0 for p in params):
        raise ValueError("draft_sample_method 'probabilistic': group greedy rows (temperature 0) separately")

    def sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = processed_probs(logits, params)                                                   # [B, V]
        return torch.cat([torch.multinomial(q[b], 1, generator=g) for b, g in enumerate(generators)]), q
    return sample


def accept_greedy_batch(logits: list[torch.Tensor], drafts: list[list[int]]) -> tuple[list[int], list[int]]:
    """Greedy acceptance of several verify segments in one pass: target logits [n_i+1, V] of [anchor, d_1..d_n_i]
    and drafts [n_i] per segment -> (accepted n_acc per segment, argmax at row n_acc per segment)."""
    best = torch.cat(logits).argmax(-1)                                                     # [R]
    dev = best.device
    counts = torch.tensor([len(d) + 1 for d in drafts], device=dev)                          # [S]
    firsts = counts.cumsum(0) - counts
    seg = torch.repeat_interleave(torch.arange(len(drafts), device=dev), counts,
                                  output_size=best.numel())                                   # [R] segment of row
    local = torch.arange(best.numel(), device=dev) - firsts[seg]                             # row within segment
    want = torch.tensor([t for d in drafts for t in d + [-1]], device=dev)                   # -1: the bonus row
    first_miss = torch.where(want != best, local, best.numel())                              # the -1 row always misses
    n_acc = torch.full_like(counts, best.numel()).scatter_reduce(0, seg, first_miss, "amin")
    n_acc, nxt = torch.stack((n_acc, best[firsts + n_acc])).tolist()                     # one device sync
    return n_acc, nxt


def accept_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """Target logits [n+1, V] of [anchor, d_1..d_n], drafts [n] -> (accepted n_acc, argmax at row n_acc)."""
    n_acc, nxt = accept_greedy_batch([logits], [drafts.tolist()])
    return n_acc[0], nxt[0]


def accept_rejection(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None,
                     generator: torch.Generator | None) -> tuple[int, int]:
    """Standard rejection sampling (spec §6). p [n+1, V] target distributions of [anchor, d_1..d_n], drafts [n]
    drawn from q [n, V] (None: point masses on the drafts) -> (accepted n_acc, emitted token). Accept d_i with
    probability min(1, p_{i-1}(d_i) / q_i(d_i)); at the first rejection emit from normalize(max(0, p - q)),
    else from p_n."""
    n = drafts.numel()
    drafts = drafts.to(p.device)
    q = F.one_hot(drafts, p.shape[-1]).to(p.dtype) if q is None else q.to(p.dtype)
    p_d = p[:n].gather(1, drafts[:, None]).squeeze(1)
    q_d = q.gather(1, drafts[:, None]).squeeze(1)
    u = torch.rand(n, generator=generator, device=p.device, dtype=p.dtype)
    n_acc = int((u * q_d <= p_d).long().cumprod(0).sum())                # u <= p/q, without dividing
    if n_acc == n:
        dist = p[n]
    else:
        dist = (p[n_acc] - q[n_acc]).clamp_min(0)
        if not bool(dist.sum() > 0):   # only through rounding: a rejection implies some p > q mass
            dist = p[n_acc]
    return n_acc, int(torch.multinomial(dist, 1, generator=generator))


@dataclass
class SpecStats:
    """Drafting counters (exported as metrics): per step, how many drafts were proposed and accepted."""
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)   # [n] = steps that accepted n drafts

    def record(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        self.histogram.extend([0] * (accepted + 1 - len(self.histogram)))
        self.histogram[accepted] += 1

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify forward (accepted drafts + the correction/bonus token): AL."""
        return 1.0 + self.mean_accepted if self.steps else 0.0


@dataclass
class SpecState:
    """One request mid-generation: `anchor` is its newest token, at position `pos`, not yet run by the target."""
    req: Hashable
    anchor: int
    pos: int
    params: SamplingParams
    generator: torch.Generator | None = None


class SpeculativeDecoder:
    """Prefill + speculative steps for requests on one target model, LatentKV and proposer."""

    def __init__(self, model: ML4, kv: LatentKV, proposer: Proposer, config: SpeculativeConfig):
        self.model, self.kv, self.proposer, self.config = model, kv, proposer, config
        self.stats = SpecStats()

    def _sample(self, logits: torch.Tensor, st: SpecState) -> int:
        if st.params.temperature == 0:
            return int(logits.argmax())
        return int(torch.multinomial(token_probs(logits[None], st.params)[0], 1, generator=st.generator))

    @torch.no_grad()
    def start(self, req: Hashable, prompt: list[int], params: SamplingParams = GREEDY,
              generator: torch.Generator | None = None, chunk: int = 256) -> SpecState:
        """Chunked prefill of the prompt (its taps feed the drafter's context path); samples the first token."""
        ids = torch.tensor(prompt, dtype=torch.long, device=self.model.device)
        for s in range(0, len(prompt), chunk):
            n = min(chunk, len(prompt) - s)
            trace = ForwardTrace(tap_layers=self.proposer.tap_layers)
            logits = self.model(ids[s:s + n], [Segment(req, s, n)], self.kv,
                                logits_at=torch.tensor([n - 1], device=ids.device), trace=trace)
            self.proposer.observe(req, trace.taps, torch.arange(s, s + n, device=ids.device))
        st = SpecState(req, 0, len(prompt), params, generator)
        st.anchor = self._sample(logits[0], st)
        return st

    @torch.no_grad()
    def step(self, st: SpecState, max_new: int) -> list[int]:
        """One draft + verify step; returns the 1..min(N + 1, max_new) tokens it emits (after the anchor)."""
        n = min(self.config.num_speculative_tokens, max_new - 1)
        dev, P = self.model.device, st.pos
        drafts, q = torch.zeros(0, dtype=torch.long, device=dev), None
        if n > 0:
            sample = draft_sampler(self.config.draft_sample_method, st.params, st.generator)
            drafts, q = self.proposer.propose(st.req, st.anchor, P, n, sample)
            drafts = drafts.to(dev)
        tokens = torch.cat((torch.tensor([st.anchor], device=dev), drafts))
        trace = ForwardTrace(tap_layers=self.proposer.tap_layers)
        logits = self.model(tokens, [Segment(st.req, P, n + 1)], self.kv, trace=trace)       # [n+1, V]
        if st.params.temperature == 0:
            n_acc, nxt = accept_greedy(logits, drafts)
        else:
            n_acc, nxt = accept_rejection(token_probs(logits, st.params), drafts, q, st.generator)
        length = P + n_acc + 1                      # the anchor and the accepted drafts stay in every cache
        self.kv.truncate(st.req, length)
        self.proposer.truncate(st.req, length)
        self.proposer.observe(st.req, {l: h[: n_acc + 1] for l, h in trace.taps.items()},
                              torch.arange(P, length, device=dev))
        self.stats.record(n, n_acc)
        st.anchor, st.pos = nxt, length
        return drafts[:n_acc].tolist() + [nxt]

    def release(self, req: Hashable) -> None:
        """Free the request's target KV and draft window."""
        self.kv.release(req)
        self.proposer.release(req)


def speculative_generate(model: ML4, kv: LatentKV, proposer: Proposer, prompt: list[int], max_tokens: int,
                         config: SpeculativeConfig, params: SamplingParams = GREEDY,
                         generator: torch.Generator | None = None, req: Hashable = 0,
                         stop_ids: tuple[int, ...] = (), chunk: int = 256) -> tuple[list[int], SpecStats]:
    """Generate up to max_tokens tokens after `prompt` with speculative decoding; releases the request."""
    dec = SpeculativeDecoder(model, kv, proposer, config)
    try:
        st = dec.start(req, prompt, params, generator, chunk)
        out = [st.anchor]
        while len(out) < max_tokens and out[-1] not in stop_ids:
            out += dec.step(st, max_tokens - len(out))
    finally:
        dec.release(req)
    for i, t in enumerate(out):
        if t in stop_ids:
            return out[: i + 1], dec.stats
    return out, dec.stats
