"""The resolver: map one request's selected (non-resident) positions to hot-buffer slots, LRU.

`HotState` is the slot metadata of one (request, index group): the layers that share one top-k selection
(an indexer owner and its sharers) see the same positions every step, so one plan serves all of them and
each layer copies only its own bytes. A hit refreshes its slot's LRU stamp; misses take the least recently
used slots not hit this step (empty slots first); misses beyond the buffer's free slots are `transient`
(copied for this step only, never cached). Everything is batched torch ops on the compute device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import lookup_triton

EMPTY = -1


class HotState:
    """Slot metadata of one hot buffer: the position each slot holds and its LRU stamp. Lookups sort the N
    slot positions (no per-position table), so device metadata stays flat as the context grows."""

    def __init__(self, n_slots: int, device: torch.device):
        self.n_slots, self.device = n_slots, device
        self.slot_pos = torch.full((n_slots,), EMPTY, dtype=torch.long, device=device)
        self.last_used = torch.full((n_slots,), EMPTY, dtype=torch.long, device=device)

    def lookup(self, positions: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
        """Slot holding each position [U], or EMPTY (Triton kernel on CUDA, sort + searchsorted elsewhere)."""
        if self.n_slots == 0:
            return torch.full_like(positions, EMPTY)
        if lookup_triton.available(self.device) if use_triton is None else use_triton:
            return lookup_triton.lookup(self.slot_pos, positions)
        held, order = torch.sort(self.slot_pos)
        idx = torch.searchsorted(held, positions).clamp(max=self.n_slots - 1)
        return torch.where(held[idx] == positions, order[idx], EMPTY)

    def drop_from(self, length: int) -> None:
        """Forget every slot holding a position >= length (rollback)."""
        stale = self.slot_pos >= length
        self.slot_pos[stale] = EMPTY
        self.last_used[stale] = EMPTY

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.slot_pos, self.last_used))


@dataclass
class Plan:
    """Where each requested position's row comes from this step.

    positions [U]; slot [U] (hot slot id, or -1 for a transient miss); hit [U] bool.
    fill_slots / fill_positions: the misses copied into slots this step; transient_positions: the rest.
    """
    positions: torch.Tensor
    slot: torch.Tensor
    hit: torch.Tensor
    fill_slots: torch.Tensor
    fill_positions: torch.Tensor

    @property
    def n_hits(self) -> int:
        return int(self.hit.sum())

    @property
    def n_misses(self) -> int:
        return self.positions.numel() - self.n_hits


def resolve(state: HotState, positions: torch.Tensor, step: int) -> Plan:
    """Resolve unique positions [U] (none resident) against the hot buffer at LRU time `step`; updates state."""
    positions = positions.to(state.device)
    slot = state.lookup(positions)
    hit = slot >= 0
    state.last_used[slot[hit]] = step
    miss_pos = positions[~hit]
    # candidates: slots not hit this step, least recently used first (empty slots carry -1); stable on ties
    stamp = state.last_used.clone()
    stamp[slot[hit]] = torch.iinfo(torch.long).max
    n_fill = min(miss_pos.numel(), state.n_slots - int(hit.sum()))
    victims = torch.argsort(stamp, stable=True)[:n_fill]
    fill_pos = miss_pos[:n_fill]
    state.slot_pos[victims] = fill_pos
    state.last_used[victims] = step
    miss_slot = torch.full_like(miss_pos, EMPTY)
    miss_slot[:n_fill] = victims
    slot[~hit] = miss_slot
    return Plan(positions, slot, hit, victims, fill_pos)
