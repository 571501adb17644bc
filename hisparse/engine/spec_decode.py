"""Speculative decoding inside the serving engine (spec §5.3, §6), for all decoding requests of a step at once.

The scheduler gives each decoding request a verify segment [anchor, d_1..d_n] at positions P..P+n (n <= N, and
never past max_tokens). Before the forward, `propose` drafts the n tokens: the drafter runs once per group of
requests that share n and the draft method (B requests in one block forward). The target then verifies every
segment in one forward, next to other requests' prefill chunks; each segment's top-k rows are one gather, so
HiSparse resolves the union of its rows' selections through the working set together. After the forward,
`accept` decides per request: greedy requests by one batched argmax over all verify rows, sampled requests by
rejection sampling with their own generator (seeded requests stay reproducible). Rejected positions are rolled
back in the target KV and the draft window, and `observe` runs the drafter's context path from the forward's taps
for every row the target kept (prompt chunks, plain decode tokens, anchors + accepted drafts).
"""

from __future__ import annotations

import torch

from ..kv.base import LatentKV
from .hooks import EngineHooks
from .runner import ScheduledStep, SegmentOutput
from .speculative import (Proposer, SpeculativeConfig, SpecStats, accept_greedy_batch, accept_rejection,
                          batch_draft_sampler, token_probs)


class Speculator:
    """Drafts before and accepts after each engine forward. `window`: the newest rows per request the proposer
    reads (its sliding window; None = all), so the context path skips older rows of long prompt chunks. `hooks`
    hear of every rollback and context-path update (rank 0 of a parallel group records them for the followers)
    and choose the drafter the speculator calls."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, kv: LatentKV, window: int | None = None,
                 hooks: EngineHooks | None = None):
        self.hooks = hooks or EngineHooks()
        self.config, self.proposer, self.kv, self.window = config, self.hooks.proposer(proposer), kv, window
        self.stats = SpecStats()

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return tuple(self.proposer.tap_layers)

    def _greedy_draft(self, params) -> bool:
        return self.config.draft_sample_method == "greedy" or params.temperature == 0

    def propose(self, step: ScheduledStep) -> None:
        """Fill step.drafts (and step.draft_probs when drafts are sampled) of every verify segment."""
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, (req, n) in enumerate(zip(step.reqs, step.num_drafts)):
            if n:
                groups.setdefault((n, self._greedy_draft(req.params)), []).append(i)
        for (n, greedy), idx in groups.items():
            reqs = [step.reqs[i] for i in idx]
            starts = [step.segments[i].start for i in idx]
            anchors = torch.tensor([r.token_slice(s, 1)[0] for r, s in zip(reqs, starts)])
            sample = batch_draft_sampler("greedy" if greedy else "probabilistic", [r.params for r in reqs],
                                         [r.generator for r in reqs])
            drafts, q = self.proposer.propose_batch([r.id for r in reqs], anchors, torch.tensor(starts), n, sample)
            for j, (i, d) in enumerate(zip(idx, drafts.tolist())):
                step.drafts[i] = d
                step.draft_probs[i] = None if q is None else q[j]

    def accept(self, step: ScheduledStep, outs: list[SegmentOutput]) -> list[list[int]]:
        """Per verify output, the tokens it emits (accepted drafts, then the correction or bonus token); rolls
        the rejected positions back in the target KV and the proposer and records the counts."""
        emitted: dict[int, list[int]] = {}
        greedy = [o for o in outs if o.req.params.temperature == 0]
        if greedy:
            drafts = [step.drafts[o.index] for o in greedy]
            n_acc, nxt = accept_greedy_batch([o.logits for o in greedy], drafts)
            for o, d, k, t in zip(greedy, drafts, n_acc, nxt):
                emitted[o.index] = d[:k] + [t]
        for o in outs:
            if o.req.params.temperature > 0:   # rejection sampling, from the request's own generator
                d = step.drafts[o.index]
                k, t = accept_rejection(token_probs(o.logits, o.req.params), torch.tensor(d),
                                        step.draft_probs[o.index], o.req.generator)
                emitted[o.index] = d[:k] + [t]
        out = []
        for o in outs:
            tokens, n = emitted[o.index], step.num_drafts[o.index]
            if len(tokens) <= n:                            # a draft was rejected: keep anchor + accepted drafts
                self.rollback(o.req.id, o.segment.start + len(tokens))
            self.stats.record(n, len(tokens) - 1)
            out.append(tokens)
        return out

    def rollback(self, req_id: str, length: int) -> None:
        """Forget the request's positions >= length in the target KV and the draft window."""
        self.hooks.rolled_back(req_id, length)
        self.kv.truncate(req_id, length)
        self.proposer.truncate(req_id, length)

    def observe(self, outs: list[SegmentOutput], kept: list[int]) -> None:
        """The drafter's context path for the first kept[i] rows of each segment (only the newest `window`)."""
        self.hooks.observed([o.index for o in outs], list(kept))
        if not self.tap_layers or not outs:
            return
        spans = [(o, max(0, k - (self.window or k)), k) for o, k in zip(outs, kept)]
        dev = next(iter(outs[0].taps.values())).device
        taps = {l: torch.cat([o.taps[l][a:b] for o, a, b in spans]) for l in self.tap_layers}
        positions = torch.cat([torch.arange(o.segment.start + a, o.segment.start + b, device=dev)
                               for o, a, b in spans])
        self.proposer.observe_batch([o.req.id for o, _, _ in spans], taps, positions, [b - a for _, a, b in spans])

    def release(self, req_id: str) -> None:
        """Free the request's draft window."""
        self.proposer.release(req_id)
