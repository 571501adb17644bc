"""Runs one scheduled step on the model through LatentKV, isolating a request whose forward fails."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.batch import Segment
from ..model.kv import LatentKV
from ..model.ml4 import ML4
from .request import Request


@dataclass
class ScheduledStep:
    """One flat forward: a segment (prefill chunk or decode token) per request."""
    reqs: list[Request]          # one per segment
    segments: list[Segment]
    tokens: list[int]            # concatenated segment tokens [N]

    def sampled(self) -> list[bool]:
        """Whether each segment ends at its request's last known token (so a new token is sampled)."""
        return [s.start + s.length == r.total_len for r, s in zip(self.reqs, self.segments)]


@dataclass
class StepResult:
    ok: list[tuple[Request, Segment]] = field(default_factory=list)     # segments whose KV is now written
    sample_reqs: list[Request] = field(default_factory=list)
    logits: torch.Tensor | None = None                                  # [len(sample_reqs), V]
    failed: list[tuple[Request, Exception]] = field(default_factory=list)


class ModelRunner:
    """Owns the model and the KV store; used only from the engine thread."""

    def __init__(self, model: ML4, kv: LatentKV):
        self.model, self.kv = model, kv

    def forward(self, step: ScheduledStep) -> torch.Tensor:
        """Logits [S, V] of the last row of every segment that samples."""
        ends, off = [], 0
        for seg, samples in zip(step.segments, step.sampled()):
            off += seg.length
            if samples:
                ends.append(off - 1)
        dev = self.model.device
        tokens = torch.tensor(step.tokens, dtype=torch.long, device=dev)
        return self.model(tokens, step.segments, self.kv, logits_at=torch.tensor(ends, dtype=torch.long, device=dev))

    def execute(self, step: ScheduledStep) -> StepResult:
        """Run the batch; if it fails, roll back and rerun each segment alone so only the failing ones fail."""
        try:
            logits = self.forward(step)
            return StepResult(list(zip(step.reqs, step.segments)),
                              [r for r, s in zip(step.reqs, step.sampled()) if s], logits)
        except Exception as e:   # noqa: BLE001 - isolated below, request by request
            if len(step.reqs) == 1:
                self.kv.truncate(step.reqs[0].id, step.segments[0].start)
                return StepResult(failed=[(step.reqs[0], e)])
        out, rows = StepResult(), []
        for req, seg in zip(step.reqs, step.segments):
            self.kv.truncate(req.id, seg.start)
            one = ScheduledStep([req], [seg], req.token_slice(seg.start, seg.length))
            try:
                logits = self.forward(one)
            except Exception as e:   # noqa: BLE001 - reported on this request only
                out.failed.append((req, e))
                continue
            out.ok.append((req, seg))
            if one.sampled()[0]:
                out.sample_reqs.append(req)
                rows.append(logits)
        out.logits = torch.cat(rows) if rows else None
        return out
