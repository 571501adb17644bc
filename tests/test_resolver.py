"""Property tests of the resolver + LRU hot buffer against a plain-Python model of LRU."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse.gpu_working_set.resolver import EXTRA, HOT, NONE, HotSlots, resolve

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


def resolve_batch(hot: HotSlots, sels: list[list[int]], slots: list[int], t: int, rows_per_seg: int = 1):
    """Resolve one step in which segment i (request slot slots[i]) selects sels[i] (nothing resident or written
    this step), spread over `rows_per_seg` query rows that repeat it (a verify or prefill segment)."""
    k = max([1] + [len(s) for s in sels])
    sel = torch.full((len(sels) * rows_per_seg, k), -1, dtype=torch.long)
    for i, s in enumerate(sels):
        for j in range(rows_per_seg):
            sel[i * rows_per_seg + j, : len(s)] = torch.tensor(s, dtype=torch.long)
    seg = torch.arange(len(sels)).repeat_interleave(rows_per_seg)
    S = len(sels)
    never = torch.full((S,), 1 << 30, dtype=torch.long)
    zeros = torch.zeros(hot.slots, dtype=torch.long)
    plan = resolve(hot, torch.tensor(slots), never, torch.zeros(S, dtype=torch.long), zeros, zeros, 0,
                   lambda r, p: r * 0, seg, sel, t)
    return plan, seg, sel


@settings(max_examples=150, deadline=None)
@given(st.lists(selections, min_size=1, max_size=3), st.integers(1, 10), st.integers(1, 3))
def test_resolver_matches_lru_model(requests: list[list[list[int]]], n_slots: int, rows_per_seg: int) -> None:
    """Several requests resolved in one batched call per step, each against its own plain-Python LRU model."""
    hot = HotSlots(n_slots, torch.device("cpu"))
    hot.fit(len(requests) + 1)
    slots = list(range(len(requests), 0, -1))               # request slots need not follow segment order
    models = [LRUModel(n_slots) for _ in requests]
    for t in range(1, max(len(r) for r in requests) + 1):
        sels = [r[t - 1] if t <= len(r) else [] for r in requests]
        plan, seg, sel = resolve_batch(hot, sels, slots, t, rows_per_seg)
        j = plan.locate(seg, sel)
        kind, local = plan.kind[j], plan.local[j]
        assert plan.n_unique == sum(len(s) for s in sels)
        expected_misses = 0
        for i, s in enumerate(sels):
            ref_hits, ref_cached = models[i].step(sorted(s), t)      # misses fill slots in position order
            rows = slice(i * rows_per_seg, (i + 1) * rows_per_seg)
            k_i, l_i, p_i = kind[rows], local[rows], sel[rows]
            assert (k_i[p_i < 0] == NONE).all()
            hot_pos = set(p_i[k_i == HOT].tolist())
            assert hot_pos == ref_hits | ref_cached                      # eviction order is LRU
            assert set(p_i[k_i == EXTRA].tolist()) == set(s) - hot_pos    # the rest are transient misses
            held = hot.pos[l_i[k_i == HOT]]                               # every HOT entry's slot holds it
            assert torch.equal(held, p_i[k_i == HOT])
            assert ((l_i[k_i == HOT] // n_slots) == slots[i]).all()       # inside its own request's slots
            mine = hot.pos[slots[i] * n_slots: (slots[i] + 1) * n_slots]
            assert set(mine[mine >= 0].tolist()) == set(models[i].map)
            assert mine[mine >= 0].unique().numel() == int((mine >= 0).sum())
            expected_misses += len(s) - len(ref_hits)
        assert plan.n_misses == expected_misses                           # one copy per missed (request, position)


def test_overflow_misses_are_transient() -> None:
    hot = HotSlots(4, torch.device("cpu"))
    hot.fit(1)
    plan, seg, sel = resolve_batch(hot, [list(range(10))], [0], 1)
    kind = plan.kind[plan.locate(seg, sel)]
    assert plan.n_misses == 10 and plan.n_transient == 6 and int((plan.miss_dest >= 0).sum()) == 4
    assert (kind[0, :4] == HOT).all() and (kind[0, 4:] == EXTRA).all()


def test_clear_forgets_rolled_back_positions() -> None:
    hot = HotSlots(8, torch.device("cpu"))
    hot.fit(2)
    resolve_batch(hot, [[1, 5, 9, 12], [1, 5, 9, 12]], [0, 1], 1)
    hot.clear(0, 9)
    plan, seg, sel = resolve_batch(hot, [[1, 5, 9, 12], [1, 5, 9, 12]], [0, 1], 2)
    kind = plan.kind[plan.locate(seg, sel)]
    assert plan.n_misses == 2                                            # request 1 kept all four
    assert (kind == HOT).all()
