"""Property tests of the resolver + LRU hot buffer against a plain-Python model of LRU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse.gpu_working_set.resolver import EMPTY, HotState, resolve

selections = st.lists(st.lists(st.integers(0, 63), min_size=0, max_size=12, unique=True), min_size=1, max_size=25)


class LRUModel:
    """Reference LRU in plain Python: each slot holds (position, last-used step); the victims for a step's
    misses are the slots not hit this step, least recently used first (empty slots first, ties by slot id)."""

    def __init__(self, n: int):
        self.slots: list[tuple[int, int]] = [(-1, -1)] * n

    @property
    def map(self) -> dict[int, int]:
        return {p: i for i, (p, _) in enumerate(self.slots) if p >= 0}

    def step(self, positions: list[int], t: int) -> tuple[set[int], set[int]]:
        where = self.map
        hits = {p for p in positions if p in where}
        for p in hits:
            self.slots[where[p]] = (p, t)
        misses = [p for p in positions if p not in where]
        free = sorted((stamp, i) for i, (p, stamp) in enumerate(self.slots) if p not in hits)
        cached = misses[: len(free)]
        for p, (_, i) in zip(cached, free):
            self.slots[i] = (p, t)
        return hits, set(cached)


@settings(max_examples=150, deadline=None)
@given(selections, st.integers(1, 10))
def test_resolver_matches_lru_model(steps: list[list[int]], n_slots: int) -> None:
    state, model = HotState(n_slots, torch.device("cpu")), LRUModel(n_slots)
    rows = torch.full((n_slots,), EMPTY, dtype=torch.long)     # what each slot "holds" (a copy of the position)
    for t, sel in enumerate(steps, start=1):
        positions = torch.tensor(sel, dtype=torch.long)
        plan = resolve(state, positions, t)
        ref_hits, ref_cached = model.step(sel, t)
        hit_positions = set(positions[plan.hit].tolist())
        assert hit_positions == ref_hits                                 # eviction order is LRU
        assert plan.n_hits + plan.n_misses == len(sel)                   # hits + misses == selected
        # every hit slot holds exactly the requested row
        assert torch.equal(rows[plan.slot[plan.hit]], positions[plan.hit])
        rows[plan.fill_slots] = plan.fill_positions
        assert set(plan.fill_positions.tolist()) == ref_cached
        # after filling, every non-transient slot returned holds its position
        kept = plan.slot >= 0
        assert torch.equal(rows[plan.slot[kept]], positions[kept])
        # no slot holds two positions, and the position -> slot map agrees with slot -> position
        held = state.slot_pos[state.slot_pos >= 0]
        assert held.unique().numel() == held.numel()
        assert set(held.tolist()) == set(model.map)
        assert torch.equal(state.lookup(held), (state.slot_pos >= 0).nonzero().squeeze(1))


def test_overflow_misses_are_transient() -> None:
    state = HotState(4, torch.device("cpu"))
    plan = resolve(state, torch.arange(10), 1)
    assert plan.n_misses == 10 and plan.fill_slots.numel() == 4
    assert (plan.slot[4:] == EMPTY).all() and (plan.slot[:4] >= 0).all()


def test_drop_from_forgets_rolled_back_positions() -> None:
    state = HotState(8, torch.device("cpu"))
    resolve(state, torch.tensor([1, 5, 9, 12]), 1)
    state.drop_from(9)
    plan = resolve(state, torch.tensor([1, 5, 9, 12]), 2)
    assert plan.hit.tolist() == [True, True, False, False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton lookup kernel needs CUDA")
def test_triton_lookup_matches_torch() -> None:
    g = torch.Generator().manual_seed(0)
    for n_slots, n_pos in ((1, 1), (7, 300), (4096, 2048), (4096, 5)):
        state = HotState(n_slots, torch.device("cuda"))
        held = torch.randperm(10 * n_slots, generator=g)[:n_slots]
        held[torch.rand(n_slots, generator=g) < 0.2] = EMPTY
        state.slot_pos.copy_(held)
        positions = torch.randint(0, 10 * n_slots, (n_pos,), generator=g).cuda()
        assert torch.equal(state.lookup(positions, use_triton=True), state.lookup(positions, use_triton=False))
