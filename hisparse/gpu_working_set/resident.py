"""Resident rows: the newest W tokens (a ring) and the first S sink tokens stay on the compute device."""

from __future__ import annotations

import torch


class ResidentWindow:
    """Ring of the newest `window` rows + `sinks` first rows of one (source layer, request), stored bytes."""

    def __init__(self, window: int, sinks: int, row_bytes: int, device: torch.device):
        self.window, self.sinks = window, sinks
        self.ring = torch.zeros(window, row_bytes, dtype=torch.uint8, device=device)
        self.sink = torch.zeros(sinks, row_bytes, dtype=torch.uint8, device=device)

    def store(self, positions: torch.Tensor, data: torch.Tensor) -> None:
        """Keep rows [T, row_bytes] of consecutive positions [T] (the last `window` go into the ring)."""
        if self.window:
            tail = slice(max(0, positions.numel() - self.window), None)
            self.ring[positions[tail] % self.window] = data[tail]
        if self.sinks:
            s = positions < self.sinks
            self.sink[positions[s]] = data[s]

    def read(self, positions: torch.Tensor) -> torch.Tensor:
        out = self.ring[positions % self.window] if self.window else self.sink[positions.clamp(max=self.sinks - 1)]
        if self.sinks:
            s = positions < self.sinks
            out[s] = self.sink[positions[s]]
        return out

    def nbytes(self) -> int:
        return self.ring.numel() + self.sink.numel()


class WindowBounds:
    """Which positions of one request are resident: [0, sinks) and [lo, length), lo >= length - window.

    After a rollback, ring entries of positions >= the new length may have overwritten older ones, so `lo`
    never moves back."""

    def __init__(self, window: int, sinks: int):
        self.window, self.sinks = window, sinks
        self.length, self.lo = 0, 0

    def advance(self, length: int) -> None:
        self.length = max(self.length, length)
        self.lo = max(self.lo, self.length - self.window)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def contains(self, positions: torch.Tensor) -> torch.Tensor:
        return (positions < self.sinks) | ((positions >= self.lo) & (positions < self.length))
