"""`ResidentPages` (the device-page map of hybrid offload) against a model of its contract over random sequences
of growth, placement with and without spilling, selections, budget cuts, re-admission and release, plus the
enumerated boundaries: doubling growth up to the budget, the map's doubling, spill order with ties, a page
`keep` protects, the device copy of the bookkeeping.

The model: device pages 0 .. allocated-1 are each free or map exactly one host page, both maps agree, `free` pops
the lowest page first, the device map (`slot_of`) and stamps equal the bookkeeping after `apply`, a page mapped in
a step starts with that step's stamp, a spill takes the least recently selected page outside `keep` (ties: the
lowest device page), and every map or unmap changes `version`."""

from __future__ import annotations

import random

import pytest
import torch

from hisparse.gpu_working_set import resolver
from hisparse.gpu_working_set.kernels import resolve as native
from hisparse.gpu_working_set.resident_pages import HOST_ONLY, ResidentPages
from hisparse.gpu_working_set.resolver import HotSlots, PageMap

CPU = torch.device("cpu")


def check(rp: ResidentPages) -> None:
    assert rp.allocated <= rp.cap <= rp.n_pages
    assert {h: d for d, h in rp.host_of.items()} == rp.dev_of
    assert len(set(rp.free)) == len(rp.free) and not set(rp.free) & set(rp.host_of)
    assert set(rp.free) | set(rp.host_of) == set(range(rp.allocated))
    assert rp.resident == len(rp.dev_of)


def check_device(rp: ResidentPages, stamps: dict[int, int]) -> None:
    """After apply: the device map equals the bookkeeping; resident pages carry the stamps the model expects."""
    want = torch.full_like(rp.slot_of, HOST_ONLY)
    for h, d in rp.dev_of.items():
        want[h] = d
    assert torch.equal(rp.slot_of, want)
    assert {d: int(rp.stamp[d]) for d in rp.host_of} == {d: stamps[d] for d in rp.host_of}


def placed_by_model(rp: ResidentPages, new: list[int], keep: set[int], spill: bool) -> tuple[dict, int]:
    """(host -> device map, spills) after placing `new`: free pages first (the last freed first), then with
    `spill` the least recently selected page outside keep (ties: the lowest device page), until none is left."""
    dev_of, free, stamps, spills = dict(rp.dev_of), list(rp.free), rp.stamp.tolist(), 0
    for h in new:
        if not free:
            cold = [(stamps[d], d, g) for g, d in dev_of.items() if g not in keep] if spill else []
            if not cold:
                break
            _, d, g = min(cold)
            del dev_of[g]
            free.append(d)
            spills += 1
        dev_of[h] = free.pop()
    return dev_of, spills


@pytest.mark.parametrize("trial", range(12))
def test_random_operations_keep_the_contract(seed: int, trial: int) -> None:
    rng = random.Random(seed * 100 + trial)
    n_pages = rng.randint(1, 9)
    rp = ResidentPages(n_pages, CPU)
    stamps: dict[int, int] = {}            # the model's stamp of every resident device page
    next_host, requests = 0, {}            # request -> its host pages
    for step in range(40):
        rp.step = step
        version, resident, spilled = rp.version, dict(rp.dev_of), rp.spilled_pages
        op = rng.random()
        if op < 0.35:                                        # a request writes new pages
            req = rng.randrange(4)
            new = list(range(next_host, next_host + rng.randint(1, 3)))
            next_host += len(new)
            rp.fit(next_host)
            if rng.random() < 0.5:
                rp.grow(rp.allocated + len(new))
            old = requests.get(req, [])
            keep = set(new) | set(rng.sample(old, min(1, len(old))))
            spill = rng.random() < 0.7
            want, spills = placed_by_model(rp, new, keep, spill)
            rp.place(new, keep, spill)
            assert rp.dev_of == want and rp.spilled_pages == spilled + spills
            stamps.update((rp.dev_of[h], step) for h in new if h in rp.dev_of)
            requests.setdefault(req, []).extend(new)
        elif op < 0.55 and rp.resident:                      # a step selects some resident pages
            for d in rng.sample(sorted(rp.host_of), rng.randint(1, rp.resident)):
                rp.stamp[d] = stamps[d] = step
        elif op < 0.65:                                      # the budget moves
            cap, allocated = rng.randint(0, n_pages), rp.allocated
            cold = sorted((int(rp.stamp[d]), d) for d in rp.host_of)
            moves = rp.limit(cap)
            if allocated <= cap:
                assert moves == [] and rp.dev_of == resident and rp.allocated == allocated
            else:
                gone = sorted(resident[h] for h in resident if h not in rp.dev_of)
                assert gone == sorted(d for _, d in cold[:max(0, len(cold) - cap)])
                assert rp.spilled_pages == spilled + len(gone) and rp.allocated == cap
                assert all(f >= cap > t for f, t in moves) and all(d < cap for d in rp.dev_of.values())
                for f, t in moves:
                    stamps[t] = stamps[f]
            assert rp.cap == cap
        elif op < 0.8 and requests:                          # spilled pages come back while pages are free
            req = rng.choice(sorted(requests))
            free, readmitted = list(rp.free), rp.readmitted_pages
            back = rp.readmit(requests[req])
            assert [h for h, _ in back] == [h for h in requests[req] if h not in resident][:len(free)]
            assert [d for _, d in back] == free[::-1][:len(back)]
            assert rp.readmitted_pages == readmitted + len(back)
            stamps.update((d, step) for _, d in back)
        elif requests:                                       # a request finishes
            pages = requests.pop(rng.choice(sorted(requests)))
            rp.release(pages)
            assert not any(h in rp.dev_of for h in pages)
            assert rp.dev_of == {h: d for h, d in resident.items() if h not in pages}
        changed = any(resident.get(h) != rp.dev_of.get(h) for h in set(resident) | set(rp.dev_of))
        assert (rp.version > version) == changed and rp.version >= version
        check(rp)
        rp.apply()
        assert not rp.pending and not rp.restamp
        check_device(rp, stamps)


def test_growth_doubles_up_to_the_budget() -> None:
    rp = ResidentPages(10, CPU)
    assert rp.grow(3) and rp.allocated == 3 and rp.free == [2, 1, 0]
    assert rp.grow(4) and rp.allocated == 6 and rp.free == [5, 4, 3, 2, 1, 0]      # at least double
    assert rp.grow(7) and rp.allocated == 10                                      # at most the budget
    assert not rp.grow(11) and rp.limit(8) == [] and rp.allocated == rp.cap == 8
    assert not rp.grow(9) and not rp.grow(2) and rp.free == [7, 6, 5, 4, 3, 2, 1, 0]
    rp.fit(3)
    assert rp.slot_of.tolist() == [HOST_ONLY] * 3
    rp.fit(4)
    assert rp.slot_of.numel() == 6                                                # the map doubles
    rp.fit(13)
    assert rp.slot_of.numel() == 13
    rp.fit(13)
    rp.fit(2)
    assert rp.slot_of.numel() == 13                                               # no growth without need


def test_spill_order_ties_keep_and_counters() -> None:
    rp = ResidentPages(3, CPU)
    rp.fit(10)
    rp.grow(3)
    version = rp.version
    rp.place([0, 1, 2], set())
    assert rp.dev_of == {0: 0, 1: 1, 2: 2} and rp.version == version + 3
    rp.apply()
    rp.stamp[:3] = torch.tensor([4, 2, 2])
    rp.step = 5
    rp.place([3], {1})                           # the coldest are device pages 1 and 2 (tie); 1 is kept
    assert 2 not in rp.dev_of and rp.dev_of[3] == 2 and rp.spilled_pages == 1
    rp.place([4], {0, 1, 3})                     # nothing may spill: 4 stays host-only
    assert 4 not in rp.dev_of and rp.spilled_pages == 1
    rp.place([4], set(), spill=False)
    assert 4 not in rp.dev_of
    rp.apply()
    assert rp.slot_of[:5].tolist() == [0, 1, HOST_ONLY, 2, HOST_ONLY] and int(rp.stamp[2]) == 5
    assert rp.count([0, 2, 3, 4]) == 2
    rp.release([1, 4])
    assert rp.free == [1]
    assert rp.readmit([2, 4]) == [(2, 1)] and rp.readmitted_pages == 1
    assert rp.readmit([4]) == [] and rp.readmitted_pages == 1
    rp.apply()
    version = rp.version
    rp.apply()
    assert rp.version == version and rp.slot_of[:5].tolist() == [0, HOST_ONLY, 1, 2, HOST_ONLY]


def test_a_limit_at_the_current_count_changes_nothing() -> None:
    rp = ResidentPages(4, CPU)
    rp.fit(8)
    rp.grow(4)
    rp.place(range(4), set())
    rp.release([0])
    rp.release([2])
    version = rp.version
    assert rp.free == [0, 2] and rp.limit(4) == [] and rp.limit(6) == []
    assert rp.free == [0, 2] and rp.version == version and rp.dev_of == {1: 1, 3: 3}       # page 2 still pops first


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.skipif(
    not native.available(), reason="no C++ compiler for the resolver kernel"))])
def test_the_resolver_stamps_only_the_pages_it_reads(fused: bool) -> None:
    """The stamps keep a scratch entry past the last page: the resolver's masked-out entries (padding, positions on
    host-only pages) stamp it, never a real page (the last one included), so the spill order sees only reads."""
    rp = ResidentPages(3, CPU)
    rp.fit(4)
    rp.grow(3)
    rp.place([0, 1, 2], set())
    rp.apply()
    hot = HotSlots(2, CPU)
    hot.fit(1)
    pages = PageMap(rp.slot_of[None, :4], 4, rp.stamp)      # host pages 0-2 on device pages 0-2, page 3 host-only
    sel = torch.tensor([[1, 13, -1, -1]])                   # page 0, page 3 (host only), padding
    run = resolver.resolve if fused else resolver.resolve_torch
    run(hot, torch.tensor([0]), torch.tensor([14]), torch.tensor([0]), torch.tensor([10]), torch.tensor([4]), 0, 4,
        torch.tensor([0]), sel, 7, pages)
    assert rp.stamp[:3].tolist() == [7, 0, 0]


def test_after_a_limit_the_lowest_free_page_goes_first() -> None:
    rp = ResidentPages(6, CPU)
    rp.fit(6)
    rp.grow(6)
    rp.place(range(6), set())
    rp.release([5, 1, 2])                    # free, popped from the end: 2 (freed last) goes first
    assert rp.free == [5, 1, 2] and rp.limit(5) == [] and rp.free == [2, 1]
    rp.place([6], set())
    assert rp.dev_of[6] == 1
