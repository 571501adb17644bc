"""`PageTable` against a model of its contract over random sequences of allocations, shares and frees (with and
without a prefix cache, fixed and growable), plus the row formulas and the per-step table.

The model: every page is free, held (by the requests whose tables list it) or parked (cached, held by none), never
two of these; a fresh pool hands out its lowest ids first and a freed page is the next one handed out; a growable
table grows by max(its size, the shortfall) and hands out the new ids only after the old free ones; an allocation
that cannot be met raises and leaves every table as it was (after evicting what parked pages it could)."""

from __future__ import annotations

import random

import pytest
import torch

from hisparse.host_pool.pages import PageTable, PoolExhausted, paged_rows, span_rows
from hisparse.host_pool.prefix_cache import PrefixCache


def check(pt: PageTable, allocated: set[int]) -> None:
    """The invariants of a page table; allocated: every page ever handed out."""
    held = {p for pages in pt.tables.values() for p in pages}
    parked = set(pt.cache.parked) if pt.cache is not None else set()
    free = pt.free_pages
    assert len(set(free)) == len(free)
    assert set(free) | held | parked == set(range(pt.n_pages))
    assert not (set(free) & held) and not (set(free) & parked) and not (held & parked)
    assert pt.refs == {p: sum(p in pages for pages in pt.tables.values()) for p in held}
    assert all(torch.equal(pt.page_ids[r], torch.tensor(pages, dtype=torch.long)) for r, pages in pt.tables.items())
    assert pt.page_ids.keys() == pt.tables.keys()
    assert pt.pages_used == pt.n_pages - len(free) and pt.parked_pages == len(parked)
    assert pt.high_water == (max(allocated) + 1 if allocated else 0)
    for r, pages in pt.tables.items():
        assert pt.pages_of(r) == len(pages) and pt.held_only_by(r) == [p for p in pages if pt.refs[p] == 1]
    if pt.cache is not None:
        assert set(pt.cache.key_of) <= held | parked and parked <= set(pt.cache.key_of)


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("growable", [False, True])
@pytest.mark.parametrize("trial", range(6))
def test_random_operations_keep_the_contract(seed: int, cached: bool, growable: bool, trial: int) -> None:
    rng = random.Random(seed * 100 + trial)
    P = rng.randint(1, 4)
    pt = PageTable(rng.randint(1, 6), P, growable, cache=PrefixCache() if cached else None)
    allocated: set[int] = set()
    lru: list[int] = []               # the parked pages, least recently used first (the model's view)
    keys = 0
    for _ in range(60):
        op = rng.random()
        live = list(pt.tables)
        if op < 0.5 or not live:                          # a request grows (or a new one starts)
            req = rng.choice(live + [f"r{rng.randint(0, 9)}"])
            before = {r: list(p) for r, p in pt.tables.items()}
            free, parked, n = list(pt.free_pages), list(lru), pt.n_pages
            want = rng.randint(0, 3 * P * 3)
            need = -(-want // P) - len(before.get(req, ()))
            evicted = lru[:max(0, min(need - len(free), len(lru)))]
            try:
                pt.ensure(req, want)
            except PoolExhausted:
                assert not growable and need > len(free) + len(parked)
                assert {r: p for r, p in pt.tables.items()} == before
                assert pt.free_pages == free + evicted          # what could be evicted was
                del lru[:len(evicted)]
                check(pt, allocated)
                continue
            del lru[:len(evicted)]
            if need <= 0:
                assert pt.tables.get(req) == before.get(req) and pt.free_pages == free
            else:
                got = pt.tables[req][len(before.get(req, ())):]
                stack = free + evicted
                short = need - len(stack)
                if short > 0:       # grew: the old free pages first, then the new ids from the lowest
                    assert growable and pt.n_pages == n + max(n, short)
                    stack = list(range(pt.n_pages - 1, n - 1, -1)) + stack
                else:
                    assert pt.n_pages == n
                assert got == stack[::-1][:need]
                allocated |= set(got)
            if cached:      # the request's full pages become cached under fresh keys
                for p in pt.tables.get(req, ())[:want // P]:
                    if not pt.cache.holds(p):
                        pt.cache.add(bytes([keys % 256, keys // 256]), p)
                        keys += 1
        elif op < 0.8:                                     # a request finishes
            req = rng.choice(live)
            pages = pt.tables[req]
            last = [p for p in reversed(pages) if pt.refs[p] == 1]
            free = list(pt.free_pages)
            pt.free(req)
            assert req not in pt.tables and req not in pt.page_ids
            lru += [p for p in last if cached and pt.cache.holds(p)]
            assert pt.free_pages == free + [p for p in last if not (cached and pt.cache.holds(p))]
        elif cached and lru:                               # a new request starts from cached pages
            pages = rng.sample(lru, rng.randint(1, len(lru))) + [p for p in pt.refs if pt.cache.holds(p)][:1]
            req = f"s{rng.randint(0, 99)}"
            if req in pt.tables:
                continue
            pt.share(req, pages)
            lru = [p for p in lru if p not in pages]
            assert pt.tables[req] == pages
        if cached:
            assert list(pt.cache.parked) == lru
        check(pt, allocated)


def test_fresh_pool_gives_lowest_ids_and_a_freed_page_next() -> None:
    pt = PageTable(4, 2)
    pt.ensure("a", 3)
    pt.ensure("b", 1)
    assert pt.tables == {"a": [0, 1], "b": [2]} and pt.high_water == 3
    pt.free("a")
    pt.ensure("c", 2)
    assert pt.tables["c"] == [0]             # pages are freed last first: page 0 was freed last
    pt.ensure("a", 4)
    assert pt.tables["a"] == [1, 3] and pt.pages_used == 4
    with pytest.raises(PoolExhausted, match="request 'b' needs 1 more pages of 2 tokens, 0 free of 4"):
        pt.ensure("b", 3)
    assert pt.tables["b"] == [2]
    grown = PageTable(2, 1, growable=True)
    grown.ensure("a", 1)
    grown.ensure("b", 5)                      # short by 4 of 2 pages: grows by max(2, 4)
    assert grown.n_pages == 6 and grown.tables["b"] == [1, 2, 3, 4, 5] and grown.free_pages == []
    with pytest.raises(ValueError, match="page_tokens: must be >= 1, got 0"):
        PageTable(2, 0)
    PageTable(2, 1)


def test_eviction_takes_the_least_recently_parked_pages_only_as_needed() -> None:
    pt = PageTable(3, 1, cache=PrefixCache())
    pt.ensure("a", 3)
    for p in range(3):
        pt.cache.add(bytes([p]), p)
    pt.free("a")                               # parked last page first: 2, 1, 0 (0 most recently)
    assert list(pt.cache.parked) == [2, 1, 0] and pt.free_pages == [] and pt.parked_pages == 3
    pt.ensure("b", 1)                          # one needed: the least recently parked goes
    assert pt.tables["b"] == [2] and list(pt.cache.parked) == [1, 0] and not pt.cache.holds(2)
    pt.share("c", [0])
    assert pt.refs[0] == 1 and list(pt.cache.parked) == [1]
    pt.share("d", [0])
    assert pt.refs[0] == 2 and pt.held_only_by("c") == [] and pt.held_only_by("b") == [2]
    pt.free("c")
    assert pt.refs[0] == 1 and 0 not in pt.cache.parked
    pt.free("d")
    assert list(pt.cache.parked) == [1, 0]
    pt.evict_keys([bytes([0])])
    assert pt.free_pages == [0] and list(pt.cache.parked) == [1]
    pt.evict(5)                                # at most what is parked
    assert pt.free_pages == [0, 1] and pt.parked_pages == 0
    assert PageTable(2, 1).parked_pages == 0


def test_rows_and_step_table() -> None:
    pt = PageTable(8, 4)
    pt.ensure("a", 9)                          # pages 0, 1, 2
    pt.free("a")
    pt.ensure("b", 5)                          # pages 0, 1 (the freed ones, last freed first)
    pt.ensure("c", 1)
    assert pt.tables == {"b": [0, 1], "c": [2]}
    table = pt.table(["c", "b", "none"])
    assert table.tolist() == [[2, 0], [0, 1], [0, 0]] and table.dtype == torch.long
    assert pt.table(["c"], width=3).tolist() == [[2, 0, 0]] and pt.table(["b"], width=3).tolist() == [[0, 1, 0]]
    assert pt.table([]).shape == (0, 1)
    assert span_rows([5, 2], 2, 7, 4) == [22, 23, 8, 9, 10]
    seg, pos = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 5, 3, 4])
    assert paged_rows(torch.tensor([[5, 2], [1, 7]]), seg, pos, 4).tolist() == [20, 9, 7, 28]
