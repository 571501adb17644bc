"""Property tests of the resolver + LRU hot buffer against a plain-Python model of LRU, on both paths (torch
code and fused CPU kernel), and the two paths against each other."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse.gpu_working_set import resolver
from hisparse.gpu_working_set.kernels import resolve as native
from hisparse.gpu_working_set.resolver import EXTRA, HOT, NONE, PAGE, STEP, WINDOW, HotSlots, PageMap, Plan, resolve
from hisparse.gpu_working_set.static_plan import resolve_static

needs_kernel = pytest.mark.skipif(not native.available(), reason="no C++ compiler for the resolver kernel")
PATHS = [pytest.param(False, id="torch"), pytest.param(True, id="native", marks=needs_kernel)]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run a test on the torch code (False) or the fused kernel (True)."""
    monkeypatch.setattr(resolver, "NATIVE", request.param)
    return request.param

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
    plan = resolve(hot, torch.tensor(slots), never, torch.zeros(S, dtype=torch.long), zeros, zeros, 0, 0, seg,
                   sel, t)
    return plan, seg, sel


@settings(max_examples=150, deadline=None,   # `path` is set once per test, for all its examples
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(selections, min_size=1, max_size=3), st.integers(1, 10), st.integers(1, 3))
def test_resolver_matches_lru_model(path: bool, requests: list[list[list[int]]], n_slots: int,
                                    rows_per_seg: int) -> None:
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


def test_overflow_misses_are_transient(path: bool) -> None:
    hot = HotSlots(4, torch.device("cpu"))
    hot.fit(1)
    plan, seg, sel = resolve_batch(hot, [list(range(10))], [0], 1)
    kind = plan.kind[plan.locate(seg, sel)]
    assert plan.n_misses == 10 and plan.n_transient == 6 and int((plan.miss_dest >= 0).sum()) == 4
    assert (kind[0, :4] == HOT).all() and (kind[0, 4:] == EXTRA).all()


def test_clear_forgets_rolled_back_positions(path: bool) -> None:
    hot = HotSlots(8, torch.device("cpu"))
    hot.fit(2)
    resolve_batch(hot, [[1, 5, 9, 12], [1, 5, 9, 12]], [0, 1], 1)
    hot.clear(0, 9)
    plan, seg, sel = resolve_batch(hot, [[1, 5, 9, 12], [1, 5, 9, 12]], [0, 1], 2)
    kind = plan.kind[plan.locate(seg, sel)]
    assert plan.n_misses == 2                                            # request 1 kept all four
    assert (kind == HOT).all()


def resolve_on(native_path: bool, hot: HotSlots, *args) -> Plan:
    """resolve on the torch code or the fused kernel."""
    prev, resolver.NATIVE = resolver.NATIVE, native_path
    try:
        return resolve(hot, *args)
    finally:
        resolver.NATIVE = prev


def random_pages(g: torch.Generator, S: int, positions: int) -> PageMap:
    """A random page map: S segments' pages (page_tokens 1-8) each on a device page of 5 or host only (-1)."""
    P = int(torch.randint(1, 9, (), generator=g))
    n_pages = 5
    dev = torch.randint(-1, n_pages, (S, -(-positions // P)), generator=g)
    return PageMap(dev, P, torch.randint(0, 4, (n_pages + 1,), generator=g))


def clone_pages(pages: PageMap | None) -> PageMap | None:
    return None if pages is None else PageMap(pages.dev, pages.page_tokens, pages.stamp.clone())


def clone(hot: HotSlots) -> HotSlots:
    twin = HotSlots(hot.n_slots, hot.device)
    twin.fit(hot.slots)
    twin.pos, twin.stamp = hot.pos.clone(), hot.stamp.clone()
    return twin


def random_step(g: torch.Generator, R: int, positions: int) -> tuple:
    """One step's resolve arguments after hot: 1-4 segments in random request slots and random row order, 1-3
    rows each (repeated positions across and within rows, -1 padding, rows sometimes ascending as the indexer
    gives them), steps starting anywhere (some entries STEP), random windows [lo, len)."""
    def randint(lo: int, hi: int, size: tuple = ()) -> torch.Tensor:
        return torch.randint(lo, hi, size, generator=g)

    S = int(randint(1, min(R, 4) + 1))
    slot_of_seg = torch.randperm(R, generator=g)[:S]
    step_start = randint(0, positions + 8, (S,))
    step_row0 = randint(0, 100, (S,))
    win_len = randint(0, positions + 1, (R,))
    win_lo = torch.minimum(randint(0, positions + 1, (R,)), win_len)
    rows = randint(1, 4, (S,))
    seg = torch.repeat_interleave(torch.arange(S), rows)
    if bool(randint(0, 2)):
        seg = seg[torch.randperm(seg.numel(), generator=g)]
    k = int(randint(1, 13))
    sel = randint(0, positions, (seg.numel(), k))
    sel[randint(0, 4, sel.shape) == 0] = -1
    if bool(randint(0, 2)):   # ascending, -1 padded at the end
        sel = torch.where(sel < 0, 1 << 50, sel).sort(dim=1).values
        sel[sel == 1 << 50] = -1
    return slot_of_seg, step_start, step_row0, win_lo, win_len, seg, sel


def random_steps(seed: int, trials: int, steps: int, max_R: int, max_positions: int, n_slots: int):
    """Consecutive random resolver steps over fresh trials: yields (trial, step, hot, args, window, sinks, released,
    stamp, pages), where `hot` is the trial's HotSlots (a request released or rolled back between steps: `released`
    (slot, position), already cleared on it), stamps may repeat, and odd trials have resident pages (hybrid)."""
    g = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        R = int(torch.randint(1, max_R + 1, (), generator=g))
        positions = int(torch.randint(4, max_positions, (), generator=g))
        window, sinks = (int(x) for x in torch.randint(0, 9, (2,), generator=g))
        hot = HotSlots(n_slots, torch.device("cpu"))
        hot.fit(R)
        stamp = 0
        for step in range(steps):
            args = random_step(g, R, positions)
            released = None
            if step and int(torch.randint(0, 4, (), generator=g)) == 0:
                released = int(torch.randint(0, R, (), generator=g)), int(torch.randint(0, positions, (), generator=g))
                hot.clear(*released)
            stamp += int(torch.randint(0, 3, (), generator=g))
            yield trial, step, hot, args, window, sinks, released, stamp, \
                random_pages(g, args[0].numel(), positions) if trial % 2 else None


@needs_kernel
@pytest.mark.parametrize("n_slots", [0, 1, 3, 16])
def test_kernel_matches_torch(seed: int, n_slots: int) -> None:
    """Fused kernel and torch code: identical plans and LRU metadata over many consecutive random steps."""
    for trial, step, hot, args, window, sinks, _, stamp, pages in random_steps(seed, 20, 8, 6, 80, n_slots):
        twin, twin_pages = clone(hot), clone_pages(pages)
        ref = resolve_on(False, hot, *args[:5], sinks, window, *args[5:], stamp, pages)
        got = resolve_on(True, twin, *args[:5], sinks, window, *args[5:], stamp, twin_pages)
        where = f"seed {seed} trial {trial} step {step}"
        for name in ("keys", "kind", "local", "extra", "miss_seg", "miss_pos", "miss_dest"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), f"{name}, {where}"
        assert ((got.n_unique, got.n_transient, got.n_resident)
                == (ref.n_unique, ref.n_transient, ref.n_resident)), where
        assert torch.equal(twin.pos, hot.pos) and torch.equal(twin.stamp, hot.stamp), where
        if pages is not None:
            assert torch.equal(twin_pages.stamp, pages.stamp), where


def test_resident_pages_come_first(path: bool) -> None:
    """A position on a resident page reads its page (PAGE, row device page * P + position % P) whatever else it
    is (sink, window, written this step), stamps that page and takes no hot slot; the others resolve as without
    pages, and only they count as hits or misses."""
    hot = HotSlots(3, torch.device("cpu"))
    hot.fit(1)
    dev = torch.full((1, 11), -1, dtype=torch.long)
    dev[0, 0], dev[0, 3], dev[0, 10] = 2, 0, 1          # positions 0-3, 12-15 and 40-43 are resident (P = 4)
    pages = PageMap(dev, 4, torch.zeros(5, dtype=torch.long))
    sel = torch.tensor([[1, 12, 41, 20, 13, 5, 11, -1]])
    plan = resolve(hot, torch.tensor([0]), torch.tensor([40]), torch.tensor([0]), torch.tensor([10]),
                   torch.tensor([14]), 2, 4, torch.tensor([0]), sel, 7, pages)
    by_pos = {int(key): (int(kind), int(local)) for key, kind, local in zip(plan.keys, plan.kind, plan.local)
              if key >= 0 and kind != NONE}
    assert {p: by_pos[p] for p in (1, 12, 13, 41)} == {1: (PAGE, 9), 12: (PAGE, 0), 13: (PAGE, 1), 41: (PAGE, 5)}
    assert by_pos[11][0] == WINDOW and by_pos[20][0] == HOT and by_pos[5][0] == HOT
    assert (plan.n_unique, plan.n_resident, plan.n_misses) == (7, 4, 2)
    assert pages.stamp[:4].tolist() == [7, 7, 7, 0]                     # device pages 0-2 read, page 3 not
    assert sorted(hot.held(0).tolist()) == [5, 20]


@needs_kernel
def test_kernel_covers_every_kind(seed: int) -> None:
    """One step with every kind of entry at once (and a transient overflow), both paths identical."""
    hot = HotSlots(3, torch.device("cpu"))
    hot.fit(3)
    slots, start, row0 = torch.tensor([2, 0]), torch.tensor([40, 30]), torch.tensor([0, 5])
    win_lo, win_len = torch.tensor([20, 0, 10]), torch.tensor([25, 0, 14])
    seg = torch.tensor([0, 1, 0])
    sel = torch.tensor([[1, 12, 41, 30, 31, 32, 33, 34, -1], [2, 22, 35, 5, 6, 7, -1, -1, -1],
                        [34, 33, 1, 12, 42, 9, 8, 7, -1]])
    twin = clone(hot)
    plans = [resolve_on(p, h, slots, start, row0, win_lo, win_len, 2, 4, seg, sel, 1)
             for p, h in ((False, hot), (True, twin))]
    kinds = set(plans[0].kind.tolist())
    assert kinds == {STEP, WINDOW, HOT, EXTRA, NONE}
    for name in ("keys", "kind", "local", "extra", "miss_seg", "miss_pos", "miss_dest"):
        assert torch.equal(getattr(plans[1], name), getattr(plans[0], name)), name
    assert torch.equal(twin.pos, hot.pos) and torch.equal(twin.stamp, hot.stamp)


@needs_kernel
def test_kernel_rejects_segments_sharing_a_request_slot() -> None:
    hot = HotSlots(4, torch.device("cpu"))
    hot.fit(2)
    stamp_before = hot.stamp.clone()
    with pytest.raises(ValueError, match="share a request slot"):
        resolve_on(True, hot, torch.tensor([1, 1]), torch.tensor([99, 99]), torch.zeros(2, dtype=torch.long),
                   torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 0, 0, torch.tensor([0, 1]),
                   torch.tensor([[3, 4], [5, 6]]), 1)
    assert torch.equal(hot.stamp, stamp_before)


@pytest.mark.parametrize("n_slots", [0, 3, 40])
def test_static_plan_is_the_eager_plan(seed: int, n_slots: int) -> None:
    """`static_plan.resolve_static` (what a full-step graph replays) and the eager torch resolver: the same
    entries, kinds and rows, the same misses and slots they fill, the same counters and LRU metadata, over many
    consecutive random steps. 40 slots per request: past 16, an unstable sort on the CPU orders tied stamps
    (free slots, slots of one step) differently, so the victims' order is checked too."""
    for trial, step, hot, args, window, sinks, released, stamp, pages in random_steps(seed, 12, 6, 5, 120, n_slots):
        if step == 0:
            twin = clone(hot)
        elif released:
            twin.clear(*released)
        twin_pages = clone_pages(pages)
        ref = resolve_on(False, hot, *args[:5], sinks, window, *args[5:], stamp, pages)
        got = resolve_static(twin, *args[:5], sinks, window, *args[5:], torch.tensor(stamp),
                             torch.ones(args[0].numel(), dtype=torch.long), True, twin_pages)
        where = f"seed {seed} trial {trial} step {step}"
        for name in ("keys", "kind", "local"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), f"{name}, {where}"
        missed = (got.kind == EXTRA) | (got.fill_dest >= 0)
        assert torch.equal(got.seg[missed], ref.miss_seg) and torch.equal(got.pos[missed], ref.miss_pos), where
        assert torch.equal(got.fill_dest[missed], ref.miss_dest), where
        assert got.counts.tolist() == [ref.n_unique, ref.n_misses, ref.n_resident], where
        real = slice(0, hot.scratch)        # (the scratch slot takes the writes of entries that fill nothing)
        assert torch.equal(twin.pos[real], hot.pos[real]), where
        assert torch.equal(twin.stamp[real], hot.stamp[real]), where
        if pages is not None:
            assert torch.equal(twin_pages.stamp, pages.stamp), where


def test_held_lists_every_position_a_slot_holds() -> None:
    """`held` returns exactly the held positions, position 0 included, and nothing of another request."""
    hot = HotSlots(4, torch.device("cpu"))
    hot.fit(2)
    resolve_batch(hot, [[0, 7, 3], [0, 1]], [0, 1], 1)
    assert sorted(hot.held(0).tolist()) == [0, 3, 7] and sorted(hot.held(1).tolist()) == [0, 1]
    hot.clear(0, 1)
    assert hot.held(0).tolist() == [0]
