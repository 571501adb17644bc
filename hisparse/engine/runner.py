"""Runs one scheduled step on the model through LatentKV, isolating a request whose forward fails."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.batch import ForwardTrace, Segment
from ..kv.base import LatentKV
from ..model.ml4 import ML4
from .cuda_graphs import DecodeGraphs
from .full_graph import FullGraphs
from .hooks import EngineFatal, EngineHooks
from .request import Request


@dataclass
class ScheduledStep:
    """One flat forward: a segment per request. A segment is a prefill chunk, a decode token, or a speculative
    verify [anchor, d_1..d_n] at positions P..P+n whose n draft ids are filled in before the forward."""
    reqs: list[Request] = field(default_factory=list)        # one per segment
    segments: list[Segment] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)      # per segment: draft tokens at its end (0: none)
    drafts: list[list[int]] = field(default_factory=list)    # per segment: the draft ids (set by the speculator)
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)   # per segment: q [n, V], None = argmax

    def add(self, req: Request, seg: Segment, num_drafts: int = 0) -> None:
        self.reqs.append(req)
        self.segments.append(seg)
        self.num_drafts.append(num_drafts)
        self.drafts.append([])
        self.draft_probs.append(None)

    def token_ids(self) -> list[int]:
        """Concatenated segment tokens [N]: known ids, then each verify segment's drafts."""
        out: list[int] = []
        for r, s, n, d in zip(self.reqs, self.segments, self.num_drafts, self.drafts):
            if len(d) != n:
                raise RuntimeError(f"request {r.id}: {n} draft slots scheduled, {len(d)} drafts proposed")
            out += r.token_slice(s.start, s.length - n) + d
        return out

    def sample_rows(self) -> list[int]:
        """Rows of each segment that sample: every row of a verify segment (anchor + drafts), the last row of a
        segment ending at its request's last known token (a new token is sampled), none otherwise."""
        return [n + 1 if s.start + s.length - n == r.total_len else 0
                for r, s, n in zip(self.reqs, self.segments, self.num_drafts)]

    def logit_rows(self) -> list[int]:
        """Rows of each segment whose logits the forward returns (its last ones): the sampling rows, or every row
        of a prompt chunk whose request asks for prompt logprobs it does not have yet (not after a preemption)."""
        return [s.length if r.params.prompt_logprobs is not None
                and len(r.prompt_logprobs) < min(s.start + s.length, len(r.prompt) - 1) else k
                for r, s, k in zip(self.reqs, self.segments, self.sample_rows())]

    def only(self, i: int) -> "ScheduledStep":
        """Segment i alone (drafts included)."""
        return ScheduledStep([self.reqs[i]], [self.segments[i]], [self.num_drafts[i]], [self.drafts[i]],
                             [self.draft_probs[i]])


@dataclass
class SegmentOutput:
    """What the forward produced for one segment whose KV is now written."""
    index: int                                  # the segment's index in its ScheduledStep
    req: Request
    segment: Segment
    logits: torch.Tensor | None                 # [sample_rows, V] (None: a prefill chunk that samples nothing)
    taps: dict[int, torch.Tensor]               # tapped layer -> hidden states [segment.length, D] ({} untapped)
    prompt_logits: torch.Tensor | None = None   # [segment.length, V]: every row (prompt logprobs asked), else None


@dataclass
class StepResult:
    ok: list[SegmentOutput] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)


def row_index(lengths: list[int], counts: list[int]) -> torch.Tensor:
    """Flat indices (CPU) of the last counts[i] rows of each segment i, segments of `lengths` rows -> [sum(counts)]."""
    n, k = torch.tensor(lengths), torch.tensor(counts)
    firsts = k.cumsum(0) - k
    seg = torch.repeat_interleave(torch.arange(len(counts)), k)
    return (n.cumsum(0) - k)[seg] + torch.arange(int(k.sum())) - firsts[seg]


class ModelRunner:
    """Owns the model and the KV store; used only from the engine thread. `tap_layers`: layers whose hidden
    states every forward returns per segment (the drafter's context path); `graphs`: runs the decode steps it
    handles (full-step or piecewise CUDA graphs), every other step runs the model's forward; `hooks` hear of every step
    (rank 0 of a parallel group sends it to the followers first)."""

    def __init__(self, model: ML4, kv: LatentKV, tap_layers: tuple[int, ...] = (),
                 graphs: DecodeGraphs | FullGraphs | None = None, hooks: EngineHooks | None = None):
        self.model, self.kv, self.tap_layers, self.graphs = model, kv, tuple(tap_layers), graphs
        self.hooks = hooks or EngineHooks()

    def forward(self, step: ScheduledStep, indices: list[int]) -> list[SegmentOutput]:
        """One forward over `step`; a SegmentOutput per segment (indices: their indices in the full step)."""
        dev = self.model.device
        counts, samples = step.logit_rows(), step.sample_rows()
        lengths = [s.length for s in step.segments]
        at = row_index(lengths, counts).to(dev)
        trace = ForwardTrace(tap_layers=self.tap_layers) if self.tap_layers else None
        tokens = torch.tensor(step.token_ids(), dtype=torch.long)    # host: the graphs send them with their inputs
        if self.graphs is not None and self.graphs.handles(step.segments, counts):
            logits = self.graphs.forward(tokens, step.segments, self.kv, trace).split(counts)
        else:
            logits = self.model(tokens.to(dev), step.segments, self.kv, logits_at=at, trace=trace).split(counts)
        taps = {l: h.split(lengths) for l, h in trace.taps.items()} if trace is not None else {}
        return [SegmentOutput(i, r, s, lg[len(lg) - k:] if k else None, {l: t[j] for l, t in taps.items()},
                              lg if n > k else None)
                for j, (i, r, s, lg, n, k) in enumerate(zip(indices, step.reqs, step.segments, logits, counts,
                                                            samples))]

    def execute(self, step: ScheduledStep) -> StepResult:
        """Run the batch between the hooks' before_forward and after_forward."""
        self.hooks.before_forward(step)
        result = self.isolated(step)
        self.hooks.after_forward()
        return result

    def isolated(self, step: ScheduledStep) -> StepResult:
        """Run the batch; if it fails, roll back and rerun each segment alone so only the failing ones fail."""
        try:
            return StepResult(self.forward(step, list(range(len(step.reqs)))))
        except EngineFatal:        # the group is broken, not one request: nothing to isolate
            raise
        except Exception as e:   # noqa: BLE001 - isolated below, request by request
            if not self.hooks.isolates_failures:
                raise EngineFatal(f"the step's forward failed ({type(e).__name__}: {e}); the parallel group "
                                  "cannot rerun it request by request") from e
            if len(step.reqs) == 1:
                self.kv.truncate(step.reqs[0].id, step.segments[0].start)
                return StepResult(failed=[(step.reqs[0], e)])
        out = StepResult()
        for i, (req, seg) in enumerate(zip(step.reqs, step.segments)):
            self.kv.truncate(req.id, seg.start)
            try:
                out.ok += self.forward(step.only(i), [i])
            except EngineFatal:
                raise
            except Exception as e:   # noqa: BLE001 - reported on this request only
                out.failed.append((req, e))
        return out
