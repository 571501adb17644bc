"""What one model forward runs on: a flat batch of token chunks, one `Segment` per request."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Segment:
    """`length` consecutive tokens of request `req` at positions start .. start+length-1."""
    req: Hashable
    start: int
    length: int


@dataclass
class ForwardTrace:
    """Optional capture of a forward's internals: per-layer selections and tapped hidden states."""
    tap_layers: tuple[int, ...] = ()
    selections: dict[int, list[torch.Tensor]] = field(default_factory=dict)   # layer -> per segment [T, k]
    taps: dict[int, torch.Tensor] = field(default_factory=dict)               # layer -> [N, D] after layer


def segment_slices(segments: list[Segment]) -> list[slice]:
    """Row ranges of each segment in the flat batch."""
    out, off = [], 0
    for s in segments:
        out.append(slice(off, off + s.length))
        off += s.length
    return out


def segment_positions(segments: list[Segment], device: torch.device | str = "cpu") -> torch.Tensor:
    """Absolute positions [N] of the flat batch."""
    return torch.cat([torch.arange(s.start, s.start + s.length, device=device) for s in segments])
