"""Hybrid offload: rows stay in resident device pages while the budget has room and spill page by page under
pressure; every step's logits stay bit-identical to the all-resident store whatever is resident."""

from __future__ import annotations

import copy

import pytest
import torch

from hisparse.core.batch import Segment
from hisparse.core.config import preset_params
from hisparse.gpu_working_set.resident_pages import HOST_ONLY
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.kv.resident import ResidentKV
from hisparse.model.tiny import random_model

PAGE = 16
CHUNK = 40
# (step a request joins, its prompt length, the step after which it is released (None: runs to the end))
SCRIPT = [(0, 120, 14), (2, 90, None), (5, 70, None), (18, 50, None)]
STEPS = 22


@pytest.fixture(scope="module")
def model():
    p = preset_params("tiny")
    p["max_position_embeddings"] = 1 << 16
    return random_model(p, seed=int(torch.randint(0, 10_000, ()).item()))


def hybrid(cfg, layout: str, pages: int | None, dtype: torch.dtype = torch.float32, slots: int = 3) -> HiSparseKV:
    """A small HiSparse store computing in `dtype` whose budget holds `slots` working sets (SCRIPT's peak) and
    `pages` resident device pages beside them (None: always offload, no budget)."""
    geometry = dict(host_pool_gib=0.004, hot_buffer_tokens=16, resident_window=8, page_tokens=PAGE)
    probe = HiSparseKV(cfg, layout, **geometry)
    gib = None if pages is None else probe.budget_gib(slots, pages)
    return HiSparseKV(cfg, layout, "cpu", dtype, device_kv_gib=gib, **geometry)


def check_invariants(kv: HiSparseKV) -> None:
    """No page both resident and spilled: the host-side maps are inverse, the device map says the same, free and
    used device pages add up, and every resident page belongs to a live request's page table."""
    res = kv.resident
    assert {d: h for h, d in res.dev_of.items()} == res.host_of
    assert len(res.free) + len(res.dev_of) == res.allocated <= res.n_pages and not set(res.free) & set(res.host_of)
    want, have = torch.full_like(res.slot_of, HOST_ONLY), res.slot_of.clone()
    for h, d in res.dev_of.items():
        want[h] = d
    for h, d in res.pending.items():     # changes since the last step reach the device with the next one
        have[h] = d
    assert torch.equal(have, want)
    live = {h for pages in kv.pages.tables.values() for h in pages}
    assert set(res.dev_of) <= live


def run(model, kvs: list, checks=None) -> list[list[torch.Tensor]]:
    """Drive every store through SCRIPT in lockstep (tokens chosen greedily from the first store's logits): chunked
    prefill, decode, joins and releases; each store's logits of every step."""
    g = torch.Generator().manual_seed(1)
    prompts = {r: torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist()
               for r, (_, n, _) in enumerate(SCRIPT)}
    done = {r: 0 for r in prompts}
    out = [[] for _ in kvs]
    for step in range(STEPS):
        live = [r for r, (join, _, end) in enumerate(SCRIPT) if join <= step and (end is None or step <= end)]
        segs, toks = [], []
        for r in live:
            n = min(CHUNK, len(prompts[r]) - done[r]) if done[r] < len(prompts[r]) else 1
            if done[r] >= len(prompts[r]):
                done[r] = len(prompts[r]) - 1       # decode: the newest token (appended below) at its position
            segs.append(Segment(r, done[r], n))
            toks += prompts[r][done[r]:done[r] + n]
        logits = [model(torch.tensor(toks), segs, kv) for kv in kvs]
        for i, lg in enumerate(logits):
            out[i].append(lg)
        ends = torch.cumsum(torch.tensor([s.length for s in segs]), 0) - 1
        for s, row in zip(segs, ends.tolist()):
            done[s.req] = s.start + s.length
            if done[s.req] >= len(prompts[s.req]):
                prompts[s.req].append(int(logits[0][row].argmax()))
                done[s.req] = len(prompts[s.req])
        for r, (_, _, end) in enumerate(SCRIPT):
            if end == step:
                for kv in kvs:
                    kv.release(r)
        if checks is not None:
            checks(step)
    return out


@pytest.mark.parametrize(("layout", "dtype"),
                         [("fp8_ds_mla", torch.float32), ("bf16", torch.float32), ("fp8_ds_mla", torch.bfloat16)],
                         ids=["fp8_ds_mla", "bf16", "bf16-model"])
def test_spill_and_readmission_stay_bit_identical(model, layout, dtype):
    """Six resident pages for up to ~15 pages of live context: joins and growth spill the coldest pages, the
    release of the first request brings spilled pages back, and every step's logits equal ResidentKV's and the
    always-offloading store's (an fp32 and a bf16 model); the rows' counters add up to the always-offloading
    store's selections."""
    model = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)   # the fixture stays fp32
    kv, always = hybrid(model.cfg, layout, 6, dtype), hybrid(model.cfg, layout, None, dtype)
    readmitted = {}

    def checks(step: int) -> None:
        check_invariants(kv)
        readmitted[step] = kv.resident.readmitted_pages

    ref, on, off = run(model, [ResidentKV(model.cfg, layout, dtype=dtype), kv, always], checks)
    assert all(torch.equal(a, b) for a, b in zip(ref, on)) and all(torch.equal(a, b) for a, b in zip(ref, off))
    s, t = kv.stats, always.stats
    assert s.spilled_pages > 0 and s.misses > 0 and s.resident_hits > 0
    release = SCRIPT[0][2]
    assert readmitted[release] == 0 < readmitted[STEPS - 1], "the release gave no page back to spilled pages"
    assert s.resident_hits + s.hits + s.misses == t.hits + t.misses
    assert s.misses < t.misses


def test_room_for_everything_is_all_resident(model):
    """A budget above every request's pages: nothing spills, nothing misses, every selected row is resident."""
    kv, always = hybrid(model.cfg, "fp8_ds_mla", 64), hybrid(model.cfg, "fp8_ds_mla", None)
    ref, on, _ = run(model, [ResidentKV(model.cfg, "fp8_ds_mla"), kv, always], lambda step: check_invariants(kv))
    assert all(torch.equal(a, b) for a, b in zip(ref, on))
    s, t = kv.stats, always.stats
    assert s.spilled_pages == 0 and s.misses == 0 and s.hits == 0 and s.host_to_device_bytes == 0
    assert s.resident_hits == t.hits + t.misses > 0
    live = [r for r, (_, _, end) in enumerate(SCRIPT) if end is None]
    assert all(kv.residency(r) == 1.0 for r in live)
    assert kv.resident_rows() == sum(kv.pages.pages_of(r) for r in live) * PAGE * len(kv.arena.owners)
    assert always.resident_rows() == 0 and always.residency(live[0]) < 1.0


def test_release_returns_every_device_page(model):
    kv = hybrid(model.cfg, "fp8_ds_mla", 6)
    run(model, [kv])
    for r in list(kv.pages.tables):
        kv.release(r)
    kv.begin_step([])
    kv.end_step()
    check_invariants(kv)
    assert kv.resident.resident == 0 and len(kv.resident.free) == kv.resident.allocated == 6
    assert kv.pool.pages_used == 0


def test_one_resident_page_among_many_spilled(model):
    """One resident page for up to ~15 pages of live context: the resolver reads the positions on it from the
    page and every other selected row through the working set, in the same pass; logits stay bit-identical and
    the counters add up to the always-offloading store's."""
    kv, always = hybrid(model.cfg, "fp8_ds_mla", 1), hybrid(model.cfg, "fp8_ds_mla", None)
    per_step, before = [], [0]

    def checks(step: int) -> None:
        check_invariants(kv)
        kv.sync_stats()
        assert not kv.all_resident or step < SCRIPT[1][0]     # (only while the first request runs alone)
        per_step.append(kv.stats.resident_hits - before[0])
        before[0] = kv.stats.resident_hits

    ref, on, off = run(model, [ResidentKV(model.cfg, "fp8_ds_mla"), kv, always], checks)
    assert all(torch.equal(a, b) for a, b in zip(ref, on)) and all(torch.equal(a, b) for a, b in zip(ref, off))
    assert sum(n > 0 for n in per_step[1:]) >= len(per_step[1:]) // 2 and kv.stats.misses > 0
    s, t = kv.stats, always.stats
    assert s.resident_hits + s.hits + s.misses == t.hits + t.misses


def test_windows_left_by_all_resident_decode_steps_are_reloaded(model):
    """A lone request decodes with every page resident, so its steps leave the resident window as it was; when a
    long request joins and most pages spill (the step resolves its selections: window rows are read from the
    window), the first request's window is loaded from the host pool first. Logits stay bit-identical to
    ResidentKV at every step."""
    kv, ref = hybrid(model.cfg, "fp8_ds_mla", 4, slots=2), ResidentKV(model.cfg, "fp8_ds_mla")
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, model.cfg.vocab_size, (n,), generator=g) for n in (40, 600))

    def step(tokens: torch.Tensor, segs: list[Segment]) -> torch.Tensor:
        want, got = model(tokens, segs, ref), model(tokens, segs, kv)
        assert torch.equal(want, got)
        return want.argmax(-1)

    nxt, n = step(a, [Segment("a", 0, 40)])[-1:], 40
    for _ in range(6):                        # "a" alone: every page resident, its window left as it was
        nxt, n = step(nxt, [Segment("a", n, 1)]), n + 1
        assert kv.resident_decode and "a" in kv.stale_windows
    out = step(torch.cat((nxt, b)), [Segment("a", n, 1), Segment("b", 0, 600)])    # 4 of 41 pages resident
    assert not kv.all_resident and not kv.stale_windows
    nxt, n = torch.stack((out[0], out[-1])), {"a": n + 1, "b": 600}
    for _ in range(3):
        nxt = step(nxt, [Segment("a", n["a"], 1), Segment("b", n["b"], 1)])
        n = {r: p + 1 for r, p in n.items()}
    assert kv.stats.misses > 0


@pytest.mark.parametrize(("b_len", "spills"), [(4 * PAGE, True), (13 * PAGE, True), (14 * PAGE, False),
                                               (20 * PAGE, False)])
def test_new_pages_spill_only_while_the_step_keeps_a_resident_share(model, b_len: int, spills: bool):
    """Two device pages, held by "a" (2 pages). "b" joins while "a" decodes into a third page: with 4 pages for
    "b" the step holds 2 of 7 resident (above 1/8) and its new pages spill a's; with 20 (2 of 23, below 1/8) they
    take no device page and a's pages stay, since a new page sits in its window and spilling a page the step
    reads from the device gains nothing. 13 and 14 pages are the boundary: 2 of 16 is 1/8 exactly, 2 of 17 below.
    Logits equal ResidentKV's either way."""
    kv, ref = hybrid(model.cfg, "fp8_ds_mla", 2, slots=2), ResidentKV(model.cfg, "fp8_ds_mla")
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randint(0, model.cfg.vocab_size, (n,), generator=g) for n in (2 * PAGE + 1, b_len))
    steps = ((a[:-1], [Segment("a", 0, 2 * PAGE)]),
             (torch.cat((a[-1:], b)), [Segment("a", 2 * PAGE, 1), Segment("b", 0, b_len)]))
    for toks, segs in steps:
        assert torch.equal(model(toks, segs, ref), model(toks, segs, kv))
        check_invariants(kv)
    first_two = set(kv.pages.tables["a"][:2])
    assert (kv.resident.spilled_pages > 0) == spills
    assert (set(kv.resident.dev_of) == first_two) != spills


def test_the_page_region_grows_only_when_the_pages_outgrow_it(model):
    """A lone request on a device with room to spare, prefilled in chunks then decoded across page boundaries:
    the resident page region grows only at a step whose pages no longer fit it, to the larger of those pages and
    twice its size (then the step's pages fill it exactly as far as they need)."""
    kv = hybrid(model.cfg, "fp8_ds_mla", 64, slots=1)
    tokens = torch.randint(0, model.cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(5))
    res, before, grew = kv.resident, 0, 0
    segs = [(0, 7), (7, 30), (37, 33)] + [(n, 1) for n in range(70, 70 + 3 * PAGE)]
    for start, n in segs:
        out = model(tokens[start:start + n], [Segment("a", start, n)], kv)
        tokens = torch.cat((tokens, out[-1:].argmax(-1))) if start + n >= 70 else tokens
        if res.allocated != before:
            assert res.resident > before and res.allocated == min(res.cap, max(res.resident, 2 * before))
            grew += 1
        assert res.resident == kv.pages.pages_of("a") <= res.allocated
        before = res.allocated
    assert grew >= 3
