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
    selections: dict = field(default_factory=dict)   # layer -> [N, k] during the forward, per segment [T, k] after
    taps: dict[int, torch.Tensor] = field(default_factory=dict)               # layer -> [N, D] after layer


def segment_positions(segments: list[Segment], device: torch.device | str = "cpu"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions [N] of the flat batch and the segment index of each row [N] (built on the host, one
    copy to the device)."""
    lengths = torch.tensor([s.length for s in segments], dtype=torch.long)
    seg = torch.repeat_interleave(torch.arange(len(segments)), lengths)
    starts = torch.tensor([s.start for s in segments], dtype=torch.long)
    first_row = torch.cumsum(lengths, 0) - lengths
    positions = starts[seg] + torch.arange(int(lengths.sum())) - first_row[seg]
    return positions.to(device), seg.to(device)


class _Padding:
    """The request of a static step's padding segments (`PAD`): it holds a page and a slot like any request, its
    rows are written and read by nobody else, and statistics leave it out."""

    def __repr__(self) -> str:
        return "PAD"


PAD = _Padding()
