"""Single-request greedy generation: chunked prefill, then one token per step through any LatentKV."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from ..core.batch import ForwardTrace, Segment
from ..kv.base import LatentKV
from ..model.ml4 import ML4


@dataclass
class Generation:
    tokens: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)   # [V] per generated token (the logits it came from)


def prefill(model: ML4, kv: LatentKV, req: Hashable, prompt: list[int], chunk: int = 256, start: int = 0,
            trace: ForwardTrace | None = None) -> torch.Tensor:
    """Run prompt tokens [start, len) in chunks; returns the last position's logits [V]. `trace` captures each
    chunk's forward in turn (it ends up holding the last chunk's)."""
    ids = torch.tensor(prompt, dtype=torch.long, device=model.device)
    last = None
    for s in range(start, len(prompt), chunk):
        n = min(chunk, len(prompt) - s)
        last = model(ids[s:s + n], [Segment(req, s, n)], kv, logits_at=torch.tensor([n - 1]), trace=trace)[0]
    return last


def greedy_generate(model: ML4, kv: LatentKV, prompt: list[int], max_tokens: int, chunk: int = 256,
                    req: Hashable = 0, stop_ids: tuple[int, ...] = (), keep_logits: bool = False,
                    trace: ForwardTrace | None = None, trace_step: int = 0) -> Generation:
    """Greedy decode `max_tokens` tokens after `prompt`; releases the request's KV at the end. `trace` captures
    the forward that produced generated token `trace_step` (0: the last prefill chunk's; i: the decode step that
    fed token i - 1 in)."""
    out = Generation([])
    try:
        logits = prefill(model, kv, req, prompt, chunk, trace=trace if trace_step == 0 else None)
        pos = len(prompt)
        for _ in range(max_tokens):
            tok = int(torch.argmax(logits))
            out.tokens.append(tok)
            if keep_logits:
                out.logits.append(logits.clone())
            if tok in stop_ids or len(out.tokens) == max_tokens:
                break
            at = trace if len(out.tokens) == trace_step else None
            logits = model(torch.tensor([tok], device=model.device), [Segment(req, pos, 1)], kv, trace=at)[0]
            pos += 1
    finally:
        kv.release(req)
    return out
