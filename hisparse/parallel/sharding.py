"""Token-to-rank sharding of decode context parallelism (spec §7).

owner(p) = floor(p / I) mod R, local(p) = floor(p / (R I)) I + p mod I, and the inverse
p = floor(local / I) R I + rank I + local mod I. Local indices are dense: the positions [0, n) a rank owns are
exactly its local indices [0, count_owned(n)), so a contiguous chunk of positions maps to a contiguous local range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

Pos = TypeVar("Pos", int, torch.Tensor)


@dataclass(frozen=True)
class Sharding:
    """Where each token position lives among `size` ranks with interleave `interleave`, seen from `rank`."""
    size: int        # R
    interleave: int  # I (vLLM cp_kv_cache_interleave_size)
    rank: int

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"dcp_size: must be >= 1, got {self.size}")
        if self.interleave < 1:
            raise ValueError(f"dcp_interleave: must be >= 1, got {self.interleave}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"dcp rank: must be in [0, {self.size}), got {self.rank}")

    def owner(self, p: Pos) -> Pos:
        return (p // self.interleave) % self.size

    def local(self, p: Pos) -> Pos:
        """Local index of position p on its owner."""
        I = self.interleave
        return (p // (self.size * I)) * I + p % I

    def global_of(self, local: Pos, rank: int | None = None) -> Pos:
        """Position of local index `local` on `rank` (default: this rank)."""
        I, rank = self.interleave, self.rank if rank is None else rank
        return (local // I) * self.size * I + rank * I + local % I

    def count_owned(self, n: Pos, rank: int | None = None) -> Pos:
        """How many of the positions [0, n) `rank` (default: this rank) owns."""
        I, rank = self.interleave, self.rank if rank is None else rank
        full, rem = n // (self.size * I), n % (self.size * I)
        tail = (rem - rank * I).clamp(0, I) if isinstance(n, torch.Tensor) else min(max(rem - rank * I, 0), I)
        return full * I + tail

    def local_range(self, start: int, end: int) -> tuple[int, int]:
        """Local indices [a, b) of the owned positions in [start, end)."""
        return self.count_owned(start), self.count_owned(end)

    def most_loaded(self, n: int) -> int:
        """Positions of [0, n) held by the rank holding the most: rank 0, which owns the first block."""
        return self.count_owned(n, 0)

    def span_of(self, n_local: int) -> int:
        """The longest context whose share on the most loaded rank fits in n_local local slots."""
        return self.global_of(n_local, 0)
