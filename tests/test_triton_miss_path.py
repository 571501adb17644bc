"""The Triton miss-path kernel against the torch reference resolver + copy (`resolver.resolve_torch`): the same
LRU state (slot positions and stamps), the same arena rows for every selected position of every member layer,
bit-identical row bytes in the arena after the copy, over random batches and the edge cases. Without CUDA the
kernel runs under Triton's interpreter on CPU tensors (tests/conftest.py), so sizes stay small."""

from __future__ import annotations

import pytest
import torch

from hisparse.core import triton_support
from hisparse.gpu_working_set.resolver import EXTRA, HOT, NONE, HotSlots, PageMap, resolve_torch
from hisparse.host_pool.pages import paged_rows

pytestmark = pytest.mark.skipif(
    not (triton_support.available() and (torch.cuda.is_available() or triton_support.interpreted())),
    reason="needs triton, and CUDA or the Triton interpreter (TRITON_INTERPRET=1 before triton is imported)")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROW_BYTES, PAGE = 16, 4


def clone_hot(h: HotSlots) -> HotSlots:
    c = HotSlots(h.n_slots, h.device)
    c.fit(h.slots)
    c.pos.copy_(h.pos)
    c.stamp.copy_(h.stamp)
    return c


class Case:
    """A random step: R request slots, S segments (distinct slots) of 1..rows query rows, k selections each
    (duplicates and -1 padding), some positions written this step or resident, a hot table warmed by earlier
    steps, M member layers reading a random host pool through random pages; with `resident` (hybrid offload),
    some pages also on one of 6 device pages (the layers share a page region: one KV owner)."""

    def __init__(self, g: torch.Generator, n_slots: int, S: int, rows: int, k: int, ctx: int, M: int = 2,
                 warm: int = 2, sel_fn=None, resident: bool = False):
        ri = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=g)   # noqa: E731
        self.R, self.S, self.M, self.k = S + 2, S, M, k
        self.hot = HotSlots(n_slots, torch.device("cpu"))
        self.hot.fit(self.R)
        self.slot_of_seg = torch.randperm(self.R, generator=g)[:S]
        self.sinks, self.window = int(ri(0, 3)), int(ri(0, 5))
        self.win_len = ri(0, ctx, self.R)
        self.win_lo = (self.win_len - self.window).clamp(min=0)
        self.step_start = ri(ctx // 2, ctx + 1, S)
        n_rows = ri(1, rows + 1, S) if S else torch.zeros(0, dtype=torch.long)
        self.seg = torch.arange(S).repeat_interleave(n_rows)
        lengths = n_rows.clone()
        self.step_row0 = torch.cumsum(lengths, 0) - lengths
        self.rows_per_seg = int(n_rows.max()) if S else 0
        n_pages = -(-ctx // PAGE)
        self.pages = torch.stack([torch.randperm(self.R * n_pages, generator=g)[:n_pages] for _ in range(S)]) \
            if S else torch.zeros(0, n_pages, dtype=torch.long)
        pool_rows = self.R * n_pages * PAGE
        self.pool = torch.randint(0, 256, ((M + 1) * pool_rows, ROW_BYTES), dtype=torch.uint8, generator=g)
        self.pool_off = torch.randperm(M + 1, generator=g)[:M] * pool_rows
        hot_rows, win_rows = self.R * n_slots, self.R * 7       # window + sinks <= 7
        page_base = 48 + win_rows + M * hot_rows
        self.n_arena = page_base + 6 * PAGE + 1       # step rows, windows, hot buffers, page region, zero row
        self.arena = torch.randint(0, 256, (self.n_arena, ROW_BYTES), dtype=torch.uint8, generator=g)
        zero = self.n_arena - 1
        self.kind_base = torch.tensor([[0, 48, 48 + win_rows + m * hot_rows, zero, zero, page_base]
                                       for m in range(M)])
        self.resident = PageMap(ri(-1, 6, S, n_pages), PAGE, ri(0, 3, 7)) if resident else None
        self.sel_fn = sel_fn or (lambda n: torch.where(ri(0, 5, n, k) == 0, -1, ri(0, ctx, n, k)))
        for t in range(1, warm + 1):     # earlier steps fill the hot table (LRU stamps differ)
            resolve_torch(self.hot, *self.tables(), self.sel_fn(self.seg.numel()), t, self.resident)
        self.sel = self.sel_fn(self.seg.numel())
        self.stamp = warm + 1

    def tables(self):
        return (self.slot_of_seg, self.step_start, self.step_row0, self.win_lo, self.win_len, self.sinks,
                self.window, self.seg)

    def reference(self, pages: PageMap | None):
        hot = clone_hot(self.hot)
        plan = resolve_torch(hot, *self.tables(), self.sel, self.stamp, pages)
        arena = self.arena.clone()
        host = paged_rows(self.pages, plan.miss_seg, plan.miss_pos, PAGE)
        fill = plan.miss_dest >= 0
        j = plan.locate(self.seg, self.sel)
        rows, idx = [], []
        for m in range(self.M):
            arena[self.kind_base[m, HOT] + plan.miss_dest[fill]] = self.pool[self.pool_off[m] + host[fill]]
        for m in range(self.M):
            at = torch.where(self.sel >= 0, (plan.local + self.kind_base[m][plan.kind])[j], -1)
            fetched = torch.cat((self.pool[self.pool_off[m] + host], self.pool[:1]))   # (+1: no miss at all)
            extra = fetched[plan.extra[j].clamp(min=0)]
            got = torch.where((plan.kind[j] == EXTRA)[..., None], extra, arena[at.clamp(min=0)])
            rows.append(torch.where((self.sel >= 0)[..., None], got, 0))
            idx.append(torch.where(plan.kind[j] == EXTRA, -2, at))
        return hot, plan, arena, torch.stack(idx), torch.stack(rows)

    def stamps(self) -> PageMap | None:
        """The resident pages with their stamps copied (each path updates its own)."""
        r = self.resident
        return None if r is None else PageMap(r.dev.to(DEV), r.page_tokens, r.stamp.clone().to(DEV))

    def kernel(self, sel: torch.Tensor | None = None, block_e: int = 8):
        from hisparse.gpu_working_set.kernels.miss_path_triton import miss_path
        hot = clone_hot(self.hot)
        hot.pos, hot.stamp = hot.pos.to(DEV), hot.stamp.to(DEV)
        arena = self.arena.clone().to(DEV)
        d = lambda t: t.to(DEV)    # noqa: E731
        sel = self.sel if sel is None else sel
        out = miss_path(hot, d(self.slot_of_seg), d(self.step_start), d(self.step_row0), d(self.win_lo),
                        d(self.win_len), self.sinks, self.window, d(self.seg), d(sel), d(torch.tensor(self.stamp)),
                        d(self.pages),
                        PAGE, self.pool.pin_memory() if DEV.type == "cuda" else self.pool, d(self.pool_off),
                        arena, d(self.kind_base), max_rows_per_seg=self.rows_per_seg, block_e=block_e,
                        resident=(pages := self.stamps()))
        return hot, out, arena, pages


def check(case: Case, **kw) -> tuple:
    pages_r = case.stamps()
    hot_r, plan, arena_r, idx_r, rows_r = case.reference(pages_r)
    hot_k, out, arena_k, pages_k = case.kernel(**kw)
    if pages_r is not None:     # (the last entry is the reference's sink for masked-out scatters)
        assert torch.equal(pages_k.stamp.cpu()[:-1], pages_r.stamp[:-1])
    # the LRU state (the last entry is the reference's sink for masked-out scatters, not state)
    assert torch.equal(hot_k.pos.cpu()[:-1], hot_r.pos[:-1]) and torch.equal(hot_k.stamp.cpu()[:-1], hot_r.stamp[:-1])
    assert torch.equal(arena_k.cpu(), arena_r)
    idx = out.idx.cpu()
    transient = idx_r == -2
    assert torch.equal(torch.where(transient, -2, idx), idx_r)
    assert bool((idx[transient] >= case.n_arena).all())
    for m in range(case.M):
        both = torch.cat((arena_k.cpu(), out.extra[m].cpu() if out.extra is not None else arena_k.cpu()[:0]))
        got = torch.where((case.sel >= 0)[..., None], both[idx[m].clamp(min=0)], 0)
        assert torch.equal(got, rows_r[m])
    head = plan.kind != NONE
    assert torch.equal(out.keys.cpu(), plan.keys) and torch.equal(out.kind.cpu()[head], plan.kind[head])
    counts = out.counts.sum(0).tolist()
    assert counts == [plan.n_unique, plan.n_misses, plan.n_resident]
    not_extra = head & (plan.kind != EXTRA)
    assert torch.equal(out.local.cpu()[not_extra], plan.local[not_extra])
    return plan


@pytest.mark.parametrize("i", range(48))
def test_random_batches(i: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 100 + i)
    ri = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))   # noqa: E731
    case = Case(g, n_slots=ri(0, 12), S=ri(1, 5), rows=ri(1, 4), k=ri(1, 10), ctx=ri(4, 40))
    check(case, block_e=[4, 8, 16][i % 3])


@pytest.mark.parametrize("i", range(16))
def test_random_batches_with_resident_pages(i: int, seed: int) -> None:
    """Hybrid offload: positions on resident pages read the page region (and stamp their pages) in the same
    launch; the rest resolve as without pages."""
    g = torch.Generator().manual_seed(seed * 100 + i)
    ri = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))   # noqa: E731
    case = Case(g, n_slots=ri(0, 12), S=ri(1, 5), rows=ri(1, 4), k=ri(1, 10), ctx=ri(4, 40), resident=True)
    check(case, block_e=[4, 8, 16][i % 3])


def test_resident_and_spilled_pages_in_one_launch(seed: int) -> None:
    """Pages 0, 2 and 4 of both segments resident, the others spilled: the positions on them are PAGE entries,
    the rest hit or miss the hot table, and the counters split them."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.tensor([0, 5, 9, 13, 17, 21])       # pages 0, 1, 2, 3, 4, 5 (PAGE = 4 positions each)
    case = Case(g, n_slots=4, S=2, rows=2, k=6, ctx=24, resident=True, sel_fn=lambda n: chosen.expand(n, 6).clone())
    case.step_start[:] = 24
    case.win_len[:] = case.win_lo[:] = 0
    case.sinks = 0
    case.resident.dev[:] = -1
    case.resident.dev[:, ::2] = torch.arange(6).view(2, 3)
    plan = check(case)
    assert (plan.n_unique, plan.n_resident) == (12, 6)


def test_empty_batch_and_empty_selections(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    empty = Case(g, n_slots=4, S=0, rows=1, k=3, ctx=16, warm=0)    # (the torch reference needs S >= 1)
    hot, out, arena, _ = empty.kernel()
    assert out.idx.shape == (2, 0, 3) and torch.equal(arena.cpu(), empty.arena)
    assert torch.equal(hot.pos.cpu(), empty.hot.pos) and torch.equal(hot.stamp.cpu(), empty.hot.stamp)
    case = Case(g, n_slots=4, S=3, rows=2, k=5, ctx=16, sel_fn=lambda n: torch.full((n, 5), -1))
    plan = check(case)
    assert plan.n_unique == 0


def test_all_hit_and_all_miss(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    same = torch.randperm(30, generator=g)[:6]
    case = Case(g, n_slots=8, S=3, rows=1, k=6, ctx=30, warm=0, sel_fn=lambda n: same.expand(n, 6).clone())
    case.step_start[:] = 30     # nothing written this step or resident: every position goes to the hot table
    case.win_len[:] = 0
    case.win_lo[:] = 0
    case.sinks = 0
    resolve_torch(case.hot, *case.tables(), case.sel, 1)
    case.stamp = 2
    plan = check(case)                       # the warm step put every position in the hot table
    assert plan.n_misses == 0 and plan.n_unique == 3 * 6
    case.hot = HotSlots(8, torch.device("cpu"))   # nothing held: every position misses
    case.hot.fit(case.R)
    plan = check(case)
    assert plan.n_misses == 3 * 6 and plan.n_transient == 0


def test_duplicates_transients_and_block_edges(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    dup = lambda n: torch.randint(0, 5, (n, 9), generator=g)   # noqa: E731  (many repeats, few positions)
    check(Case(g, n_slots=3, S=2, rows=3, k=9, ctx=40, sel_fn=dup), block_e=4)
    plan = check(Case(g, n_slots=2, S=3, rows=3, k=7, ctx=60, warm=0,
                      sel_fn=lambda n: torch.randint(20, 60, (n, 7), generator=g)), block_e=16)
    assert plan.n_transient > 0      # more distinct misses than slots: copied for this step only


def test_non_contiguous_selection(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    case = Case(g, n_slots=6, S=3, rows=2, k=5, ctx=30)
    wide = torch.full((case.seg.numel(), 10), -7, dtype=torch.long)
    wide[:, ::2] = case.sel
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    check(case, sel=strided.to(DEV))
