"""Single-request greedy generation: chunked prefill, then one token per step through any LatentKV."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from ..model.batch import ForwardTrace, Segment
from ..model.kv import LatentKV
from ..model.ml4 import ML4


@dataclass
class Generation:
    tokens: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)   # [V] per generated token (the logits it came from)


def prefill(model: ML4, kv: LatentKV, req: Hashable, prompt: list[int], chunk: int = 256, start: int = 0,
            trace: ForwardTrace | None = None) -> torch.Tensor:
    """Run prompt tokens [start, len) in chunks; returns the last position's logits [V]. `trace` captures each
    chunk's forward in turn (the last chunk's is what it holds at the end)."""
    ids = torch.tensor(prompt, dtype=torch.long, device=model.device)
    last = None
    for s in range(start, len(prompt), chunk):
        n = min(chunk, len(prompt) - s)
        last = model(ids[s:s + n], [Segment(req, s, n)], kv, logits_at=torch.tensor([n - 1]), trace=trace)[0]
    return last


def greedy_generate(model: ML4, kv: LatentKV, prompt: list[int], max_tokens: int, chunk: int = 256,
                    req: Hashable = 0, stop_ids: tuple[int, ...] = (), keep_logits: bool = False,
                    prefill_trace: ForwardTrace | None = None) -> Generation:
    """Greedy decode `max_tokens` tokens after `prompt`; releases the request's KV at the end. `prefill_trace`
    ends up holding the last prefill chunk's forward (its selections include the last prompt position's)."""
    out = Generation([])
    try:
        logits = prefill(model, kv, req, prompt, chunk, trace=prefill_trace)
        pos = len(prompt)
        for _ in range(max_tokens):
            tok = int(torch.argmax(logits))
            out.tokens.append(tok)
            if keep_logits:
                out.logits.append(logits.clone())
            if tok in stop_ids or len(out.tokens) == max_tokens:
                break
            logits = model(torch.tensor([tok], device=model.device), [Segment(req, pos, 1)], kv)[0]
            pos += 1
    finally:
        kv.release(req)
    return out
