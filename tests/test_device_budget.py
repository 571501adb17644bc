"""The device budget (`--device-kv-gib`) of a HiSparse store: every running request's working set first (admission
counts them: a request waits while its own does not fit), resident pages in the rest; a new slot takes its room
from the coldest resident pages, and outputs stay exact whatever the budget leaves resident."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from hisparse.core.batch import Segment
from hisparse.engine.engine import Engine
from hisparse.engine.generate import greedy_generate
from hisparse.engine.request import SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.gpu_working_set.resident_pages import ResidentPages
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.kv.resident import ResidentKV
from hisparse.kv.settings import KVSettings

pytestmark = pytest.mark.usefixtures("single_thread")
PAGE = 16
GEOMETRY = dict(host_pool_gib=0.004, hot_buffer_tokens=16, resident_window=8, page_tokens=PAGE)


def budget(cfg, slots: int, pages: int) -> float:
    """device_kv_gib holding exactly `slots` working sets and `pages` resident pages beside them."""
    return HiSparseKV(cfg, "fp8_ds_mla", **GEOMETRY).budget_gib(slots, pages)


def store(cfg, slots: int, pages: int, hybrid: bool = True) -> HiSparseKV:
    return HiSparseKV(cfg, "fp8_ds_mla", "cpu", torch.float64, device_kv_gib=budget(cfg, slots, pages),
                      hybrid=hybrid, **GEOMETRY)


def used(kv: HiSparseKV) -> int:
    """Budgeted device bytes the store holds: its slots' working sets and its allocated resident pages."""
    pages = 0 if kv.resident is None else kv.resident.allocated * kv.page_bytes
    return kv.arena.slots * kv.working_set_bytes() + pages


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "hisparse"])
def test_admission_counts_working_sets(seed: int, hybrid: bool) -> None:
    """A budget of two working sets (and one page) runs five requests two at a time (max_num_seqs 4): the others
    wait, never more than two slots exist, and every request gets its lone greedy tokens."""
    model = tiny_model(seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(20, 70, (5,), generator=g)]
    kv = store(model.cfg, 2, 1, hybrid)
    assert kv.max_working_sets() == 2
    engine = Engine(model, kv, SchedulerConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64))
    params = SamplingParams(max_tokens=12, temperature=0.0)
    reqs = [engine.add_request(p, params) for p in prompts]
    most, waited = 0, False
    while engine.has_work() or not engine.inbox.empty():
        st = engine.step()
        most = max(most, st.num_running)
        waited |= st.num_running == 2 and st.num_waiting > 0
        assert kv.arena.slots <= 2 and used(kv) <= kv.budget
    assert most == 2 and waited
    for p, r in zip(prompts, reqs):
        ref = greedy_generate(model, ResidentKV(model.cfg, "fp8_ds_mla", dtype=torch.float64), p, 12)
        assert r.output == ref.tokens and r.finish_reason == "length"
    assert kv.reserved == {} and not kv.slot_of
    # the store's own admission: a third request waits until one of two ends
    assert kv.admit("a", 10) == 0 and kv.admit("b", 10) == 0 and kv.admit("c", 10) is None
    assert kv.reserve("a", 40), "a request holding a working set grows without another"
    kv.release("a")
    assert kv.admit("c", 10) == 0


def test_a_new_slot_takes_its_room_from_the_coldest_pages(seed: int) -> None:
    """One request holds more pages than two slots leave room for. When a second request's slot is made, the
    coldest pages spill (by the step stamps of their last selection, ties by device page), the others move below
    the new page count with their rows, and both requests' logits stay bit-identical to ResidentKV's."""
    model = tiny_model(seed)
    kv, ref = store(model.cfg, 2, 3), ResidentKV(model.cfg, "fp8_ds_mla", dtype=torch.float64)
    lone, shared = kv.page_room(1), kv.page_room(2)
    assert shared == 3 < lone
    g = torch.Generator().manual_seed(seed)
    n = (lone - 1) * PAGE + 4                                 # all of "a" resident while it is alone
    a, b = (torch.randint(0, model.cfg.vocab_size, (k,), generator=g) for k in (n, 30))

    def step(tokens: torch.Tensor, segs: list[Segment]) -> torch.Tensor:
        want, got = model(tokens, segs, ref), model(tokens, segs, kv)
        assert torch.equal(want, got) and used(kv) <= kv.budget
        return want.argmax(-1)

    nxt = step(a, [Segment("a", 0, n)])[-1:]
    for i in range(5):
        nxt = step(nxt, [Segment("a", n + i, 1)])
    n += 5
    res = kv.resident
    assert res.resident == kv.pages.pages_of("a") > shared
    stamps = res.stamp[: res.allocated].tolist()
    keep = {res.host_of[d] for _, d in sorted((stamps[d], d) for d in res.host_of)[res.resident - shared:]}
    spilled = res.spilled_pages
    kv.fit_slots(2, kv.arena.step_cap)           # the call a new request's first step makes
    assert set(res.dev_of) == keep and res.spilled_pages == spilled + len(stamps) - shared
    assert res.allocated == shared and kv.arena.page_rows == shared * PAGE and max(res.host_of) < shared
    res.apply()
    for h, d in res.dev_of.items():              # every resident page's rows moved with it
        rows = slice(h * PAGE, (h + 1) * PAGE)
        written = min(PAGE, n - PAGE * kv.pages.tables["a"].index(h))
        for o in kv.arena.owners:
            base = kv.arena.page_base[o] + d * PAGE
            assert torch.equal(kv.arena.data[base: base + written], kv.pool.layer_view(o)[rows][:written])
    out = step(torch.cat((nxt, b)), [Segment("a", n, 1), Segment("b", 0, 30)])
    nxt, pos = torch.stack((out[0], out[-1])), {"a": n + 1, "b": 30}
    for _ in range(4):
        nxt = step(nxt, [Segment("a", pos["a"], 1), Segment("b", pos["b"], 1)])
        pos = {r: p + 1 for r, p in pos.items()}
    assert kv.stats.misses > 0 and kv.arena.slots == 2


def test_limit_spills_the_coldest_and_keeps_the_stamps_of_moved_pages() -> None:
    res = ResidentPages(8, torch.device("cpu"))
    res.fit(108)
    res.grow(8)
    res.place(range(100, 108), set())
    res.apply()
    res.stamp[:8] = torch.tensor([5, 1, 7, 1, 9, 3, 8, 6])       # device page d holds host page 100 + d
    moves = res.limit(5)
    # the 3 coldest: pages 1 and 3 (stamp 1, lower id first), then 5 (stamp 3)
    assert sorted(res.dev_of) == [100, 102, 104, 106, 107] and res.spilled_pages == 3
    assert sorted(moves) == [(6, 1), (7, 3)] and res.allocated == res.cap == 5 and not res.free
    res.apply()
    assert res.slot_of[100:108].tolist() == [0, -1, 2, -1, 4, -1, 1, 3]
    assert res.stamp[:5].tolist() == [5, 8, 7, 6, 9]
    assert not res.grow(8), "the page count stays within the room the slots leave"


def test_budget_errors_name_the_flag(seed: int) -> None:
    model = tiny_model(seed)
    with pytest.raises(ValueError, match="device_kv_gib: .* less than one request's working set"):
        KVSettings(host_pool_gib=0.004, device_kv_gib=budget(model.cfg, 1, 0) * 0.99,
                   hot_buffer_tokens=16, resident_window=8, page_tokens=PAGE).build(model.cfg)
    with pytest.raises(ValueError, match="holds 3 working sets .* fewer than max_num_seqs = 4"):
        store(model.cfg, 3, 0).reserve_device(4, 128, 64)
    store(model.cfg, 3, 0).reserve_device(3, 128, 64)      # exactly as many working sets as max_num_seqs
    kv = store(model.cfg, 3, 2)
    kv.reserve_device(3, 128, 64)
    assert kv.arena.slots == 3 and kv.resident.cap == 2 == kv.page_room(3)
    ws, pb = kv.working_set_bytes(), kv.page_bytes
    assert 3 * ws + 2 * pb <= kv.budget < 3 * ws + 3 * pb


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "hisparse"])
def test_device_nbytes_is_the_most_the_store_holds(seed: int, hybrid: bool) -> None:
    """After `reserve_device`, `device_nbytes` (the figure the connector reports to vLLM) is what the store's
    device buffers come to once its page region has grown to the room the slots leave, and it does not change
    while a request runs: a request long enough to fill that room then holds exactly that much."""
    model = tiny_model(seed)
    kv = store(model.cfg, 2, 3, hybrid)
    kv.reserve_device(2, 256, 64)
    engine = Engine(model, kv, SchedulerConfig(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64))
    total = kv.device_nbytes()

    def held() -> int:
        return sum(t.nbytes for t in kv.device_buffers())
    assert held() <= total
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.cfg.vocab_size, (8 * PAGE,), generator=g).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
    assert kv.device_nbytes() == total
    if hybrid:
        assert kv.resident.allocated == kv.resident.cap == 3
    assert held() == total
    assert kv.device_bytes("never admitted") == {"latent": 0, "resident_pages": 0, "hot_metadata": 0,
                                                 "index_keys": 0}
