"""Prefix caching: full pages stay cached after their request ends and a later request that starts with the same
tokens skips their prefill; its logits equal those of the same request served without the cache, bit for bit."""

from __future__ import annotations

import pytest
import torch

from hisparse.core.batch import Segment
from hisparse.core.config import preset_params
from hisparse.engine.engine import Engine
from hisparse.engine.request import SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.kv.resident import ResidentKV
from hisparse.kv.settings import KVSettings
from hisparse.model.tiny import builtin_tiny, random_model
from hisparse.model.weights import load_model
from hisparse.parallel.context import DCPContext
from hisparse.parallel.launch import launch as launch_ranks
from hisparse.parallel.leader import Leader
from hisparse.parallel.serve import run_follower
from hisparse.parallel.sharded_kv import ShardedKV

pytestmark = pytest.mark.usefixtures("single_thread")

PAGE = 16
CHUNK = 16


@pytest.fixture(scope="module")
def model():
    p = preset_params("tiny")
    p["max_position_embeddings"] = 1 << 16
    return random_model(p, seed=int(torch.randint(0, 10_000, ()).item()))


def store(cfg, kind: str, layout: str, caching: bool, dtype: torch.dtype = torch.float32, pool_gib: float = 0.004):
    """A small store of `kind`: resident (ResidentKV), hisparse (always offload), hybrid (room for 64 pages) or
    spilling (hybrid with room for 3 pages); '-triton': on the Triton kernels (interpreted on the CPU)."""
    kind, _, kernels = kind.partition("-")
    kernels = kernels or "torch"
    if kind == "resident":
        return ResidentKV(cfg, layout, dtype=dtype, page_tokens=PAGE, prefix_caching=caching, kernels=kernels)
    pages = {"hisparse": None, "hybrid": 64, "spilling": 3}[kind]
    gib = None if pages is None else gib_for(cfg, 4, pages, layout)
    return HiSparseKV(cfg, layout, "cpu", dtype, host_pool_gib=pool_gib, hot_buffer_tokens=16, resident_window=8,
                      page_tokens=PAGE, device_kv_gib=gib, prefix_caching=caching, kernels=kernels)


def serve(model, kv, req: str, tokens: list[int], decode: int) -> tuple[list[torch.Tensor], int]:
    """Admit req (its cached prefix, if any), prefill the rest in CHUNK-token chunks from position 0's grid, then
    decode greedily; the logits of every step's last row, and the tokens the request started from."""
    start = kv.admit(req, len(tokens) + decode, tokens[:-1])
    assert start is not None
    tokens, out, pos = list(tokens), [], start

    def forward(n: int) -> torch.Tensor:
        nonlocal pos
        logits = model(torch.tensor(tokens[pos:pos + n]), [Segment(req, pos, n)], kv)[-1]
        pos += n
        kv.commit_prefix(req, lambda s, k: tokens[s:s + k], pos)
        return logits

    while pos < len(tokens):
        last = forward(min(CHUNK - pos % CHUNK, len(tokens) - pos))
    out.append(last)
    for _ in range(decode):
        tokens.append(int(last.argmax()))
        last = forward(1)
        out.append(last)
    return out, start


@pytest.mark.parametrize("kind, layout", [
    *((k, l) for k in ("resident", "hisparse", "hybrid", "spilling") for l in ("fp8_ds_mla", "bf16")),
    pytest.param("spilling-triton", "fp8_ds_mla", marks=pytest.mark.slow)])   # the miss-path kernel, interpreted
def test_hit_is_bit_identical_to_miss(model, kind: str, layout: str) -> None:
    """A (doc + q1) runs and ends; B (doc + q2, diverging mid-page) starts from the doc's full pages, C (the first
    two pages of the doc, then other tokens, then the doc's later pages again) from two pages only. Every logit of
    B and C equals that of the same request on a store without the cache, and the cache's counters add up."""
    g = torch.Generator().manual_seed(7)
    doc = torch.randint(0, model.cfg.vocab_size, (87,), generator=g).tolist()       # 5 full pages + 7 tokens
    q1, q2 = (torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 12))
    other = torch.randint(0, model.cfg.vocab_size, (PAGE,), generator=g).tolist()
    c = doc[:2 * PAGE] + other + doc[3 * PAGE:] + q1
    kv = store(model.cfg, kind, layout, caching=True)
    serve(model, kv, "a", doc + q1, 3)
    kv.release("a")
    assert kv.cached_pages() == (len(doc + q1) + 3) // PAGE and kv.pages.pages_used == kv.cached_pages()
    for req, tokens, want in (("b", doc + q2, 5 * PAGE), ("c", c, 2 * PAGE)):
        got, start = serve(model, kv, req, tokens, 4)
        ref, _ = serve(model, store(model.cfg, kind, layout, caching=False), req, tokens, 4)
        assert start == want
        assert all(torch.equal(x, y) for x, y in zip(got, ref)), f"{req}: a hit changed the logits"
        kv.release(req)
    assert kv.stats.prefix_hits == 7 * PAGE
    assert kv.stats.prefix_queries == sum(len(t) - 1 for t in (doc + q1, doc + q2, c))
    assert kv.pages.pages_used == kv.cached_pages() and not kv.pages.refs


GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def gib(cfg, pages: int) -> float:
    """GiB of `pages` pages of the host pool."""
    probe = HiSparseKV(cfg, "fp8_ds_mla", host_pool_gib=0.001, page_tokens=PAGE)
    return pages * probe.pool.page_bytes / (1 << 30)


def gib_for(cfg, slots: int, pages: int, layout: str = "fp8_ds_mla") -> float:
    """device_kv_gib of `slots` working sets (4: the engines' max_num_seqs) and `pages` resident pages beside them."""
    return HiSparseKV(cfg, layout, host_pool_gib=0.001, hot_buffer_tokens=16, resident_window=8,
                      page_tokens=PAGE).budget_gib(slots, pages)


def engine(model, kv, seqs: int = 4) -> Engine:
    return Engine(model, kv, SchedulerConfig(max_model_len=512, max_num_seqs=seqs, max_num_batched_tokens=64))


def documents(model, n_docs: int, doc_len: int, questions: int, seed: int = 3) -> list[list[int]]:
    """`questions` prompts over each of n_docs documents: the document, then a 5- to 20-token question."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_docs):
        doc = torch.randint(0, model.cfg.vocab_size, (doc_len,), generator=g).tolist()
        out += [doc + torch.randint(0, model.cfg.vocab_size, (int(torch.randint(5, 21, (), generator=g)),),
                                    generator=g).tolist() for _ in range(questions)]
    return out


def run_waves(model, kv, waves: list[list[list[int]]], seqs: int = 4) -> list[list[int]]:
    """Each wave's prompts run concurrently, the waves one after another; every request's output tokens."""
    e = engine(model, kv, seqs)
    return [r.output for wave in waves for r in e.generate(wave, GREEDY)]


def test_engine_hits_shared_pages_and_returns_the_pool(model) -> None:
    """Questions over two documents, one alone, then three at once (sharing the cached pages): the tokens equal
    a server's without the cache, concurrent requests hold the same pages, and once every request ends the pool
    holds exactly the cache's pages."""
    ps = documents(model, 2, 70, 3)
    waves = [[ps[0]], [ps[1], ps[2], ps[3]], [ps[4], ps[5]]]
    kv = store(model.cfg, "spilling", "fp8_ds_mla", caching=True)
    shared = []
    kv_admit = kv.admit

    def admit(req, n, tokens=()):
        out = kv_admit(req, n, tokens)
        shared.append(max(kv.pages.refs.values(), default=0))
        return out
    kv.admit = admit
    got = run_waves(model, kv, waves)
    assert got == run_waves(model, store(model.cfg, "spilling", "fp8_ds_mla", caching=False), waves)
    assert kv.stats.prefix_hits == 4 * (70 // PAGE) * PAGE      # ps[1], ps[2]: ps[0]'s document; ps[4], ps[5]: ps[3]'s
    assert max(shared) >= 2, "no cached page was held by two requests at once"
    assert kv.pages.pages_used == kv.cached_pages() > 0 and not kv.pages.refs and not kv.reserved


def test_eviction_under_pool_pressure_keeps_running_requests(model) -> None:
    """A 14-page pool: two documents' pages stay cached after their requests, then two requests of other prompts
    need the room: parked pages are evicted least recently used first, a document's last pages before its first
    (never a page a running request holds); tokens equal the cache-off server's, and a later question over the
    second document finds what is left of it."""
    cfg = model.cfg
    ps = documents(model, 4, 60, 1, seed=5)
    waves = [[ps[0]], [ps[1]], [ps[2], ps[3]], [ps[1][:60] + ps[0][60:]]]

    def small(caching: bool) -> HiSparseKV:
        return HiSparseKV(cfg, "fp8_ds_mla", host_pool_gib=gib(cfg, 14), hot_buffer_tokens=16,
                          resident_window=8, page_tokens=PAGE, device_kv_gib=gib_for(cfg, 4, 4),
                          prefix_caching=caching)
    kv = small(True)
    got = run_waves(model, kv, waves)
    assert got == run_waves(model, small(False), waves)
    assert kv.pool.n_pages == 14 and kv.stats.prefix_hits == 3 * PAGE    # ps[1]'s first three pages were left
    assert kv.admit("probe", 100, ps[0][:-1]) == 0, "ps[0]'s pages (the least recently used) were not evicted"
    kv.release("probe")
    assert kv.pages.pages_used == kv.cached_pages() and not kv.pages.refs


def test_preempted_request_recomputes_from_its_cached_pages(model) -> None:
    """A resident store too small for every request's growth: the newest request is preempted, its full pages
    stay cached, and when it is readmitted it starts from them; tokens equal those of the cache-off store."""
    ps = documents(model, 3, 64, 1, seed=9)     # lengths fixed (ignore_eos): the same preemptions whatever the model
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def run(caching: bool) -> tuple[list[list[int]], ResidentKV, Engine]:
        kv = ResidentKV(model.cfg, "fp8_ds_mla", budget_tokens=10 * PAGE, page_tokens=PAGE, prefix_caching=caching)
        e = engine(model, kv)
        return [r.output for r in e.generate(ps, params)], kv, e

    (got, kv, e), (want, _, _) = run(True), run(False)
    assert got == want
    assert e.scheduler.num_preemptions > 0 and kv.stats.prefix_hits >= 4 * PAGE
    assert kv.pages.pages_used == kv.cached_pages() and not kv.pages.refs


DCP_POOL_GIB = 0.05


def dcp_prompts(vocab: int) -> list[list[int]]:
    """Three questions over one 150-token document."""
    g = torch.Generator().manual_seed(4)
    doc = torch.randint(1000, vocab, (150,), generator=g).tolist()
    return [doc + torch.randint(1000, vocab, (n,), generator=g).tolist() for n in (7, 12, 20)]


def dcp_waves(model, kv, hooks=None) -> list[list[int]]:
    """The first question alone, then the other two at once; every request's output tokens."""
    e = Engine(model, kv, SchedulerConfig(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64), hooks=hooks)
    ps = dcp_prompts(model.cfg.vocab_size)
    out = [r.output for wave in ([ps[0]], ps[1:]) for r in e.generate(wave, GREEDY)]
    if hooks is not None:
        e.stop()
    return out


def dcp_model():
    """The builtin tiny checkpoint in fp64: greedy tokens of a DCP group and of one rank are compared exactly, and
    the ranks' attention combine reassociates sums, which in fp32 can flip a near-tie of the random model."""
    return load_model(builtin_tiny()).to(torch.float64)


def dcp_store(model, group=None, interleave: int = 1, caching: bool = True):
    """The serving store (hybrid, three resident pages), as DCP rank `group.rank`'s shard (None: one rank)."""
    kv = KVSettings(host_pool_gib=DCP_POOL_GIB, hot_buffer_tokens=16, resident_window=8, page_tokens=PAGE,
                    device_kv_gib=gib_for(model.cfg, 4, 3),
                    enable_prefix_caching=caching).build(model.cfg, dtype=model.dtype)
    return kv if group is None else ShardedKV(kv, DCPContext(group, interleave))


def dcp_rank(group, interleave: int) -> dict:
    """Every rank of a DCP group with prefix caching: rank 0 runs the waves, the others replay them."""
    model = dcp_model()
    kv = dcp_store(model, group, interleave)
    if group.rank > 0:
        run_follower(group, model, kv, None)
    else:
        leader = Leader(group, kv)
        leader.start_up(model)
        tokens = dcp_waves(model, kv, leader)
    return {"tokens": tokens if group.rank == 0 else None, "hits": kv.stats.prefix_hits,
            "cached": kv.cached_pages(), "used": kv.pages.pages_used, "held": len(kv.pages.refs)}


@pytest.mark.parametrize("interleave", [1, 8])
def test_dcp_two_ranks_with_hits_equal_one(interleave: int) -> None:
    """DCP 2 (interleave 1 and 8) with prefix caching: the two later questions start from the document's cached
    units on both ranks (each rank caching its own rows) and the tokens equal one rank's, with and without the
    cache."""
    model = dcp_model()
    one = dcp_store(model)
    want = dcp_waves(model, one)
    assert dcp_waves(model, dcp_store(model, caching=False)) == want and one.stats.prefix_hits == 2 * 144
    lead, follow = launch_ranks(dcp_rank, 2, interleave, threads=1, timeout_s=60.0, deadline_s=300.0)
    assert lead["tokens"] == want
    unit = 2 * PAGE   # lcm(16, I) = 16 positions per rank per unit
    assert lead["hits"] == 2 * (150 // unit * unit)
    for rank in (lead, follow):
        assert rank["cached"] > 0 and rank["used"] == rank["cached"] and rank["held"] == 0


def test_speculative_hits_keep_the_drafters_window() -> None:
    """DSpark with prefix caching: a hit still computes the drafter's window of rows (the drafter reads their
    hidden states), so the matched prefix stops that far before the prompt's end; greedy tokens equal decoding
    without the cache and without speculation."""
    from hisparse.engine.speculative import SpeculativeConfig
    model = load_model(builtin_tiny())
    window = model.cfg.mtp.sliding_window
    g = torch.Generator().manual_seed(11)
    doc = torch.randint(1000, model.cfg.vocab_size, (6 * PAGE + window,), generator=g).tolist()
    ps = [doc + torch.randint(1000, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 9)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run(caching: bool, spec: SpeculativeConfig | None) -> tuple[list[list[int]], HiSparseKV]:
        kv = store(model.cfg, "hybrid", "fp8_ds_mla", caching)
        e = Engine(model, kv, SchedulerConfig(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64),
                   speculative=spec)
        return [r.output for p in ps for r in e.generate([p], params)], kv

    spec = SpeculativeConfig(num_speculative_tokens=2)
    (got, kv), (want, _) = run(True, spec), run(False, None)
    assert got == want
    # the second prompt reuses every full page of the document but the drafter's window
    assert kv.stats.prefix_hits == (len(ps[1]) - window) // PAGE * PAGE > 0


@pytest.mark.parametrize("cached_pages", [1, 3])
def test_an_attached_request_has_the_window_of_its_cached_positions(model, cached_pages: int) -> None:
    """A request that starts from n cached positions holds [max(0, n - W), n) in its resident window (W = 32),
    the positions the resolver serves from the device without a hot slot: all of them when n <= W (without sink
    tokens position 0 is only there)."""
    kv = HiSparseKV(model.cfg, "fp8_ds_mla", "cpu", torch.float32, host_pool_gib=0.004, hot_buffer_tokens=16,
                    resident_window=32, sink_tokens=0, page_tokens=PAGE, prefix_caching=True)
    g = torch.Generator().manual_seed(11)
    doc = torch.randint(0, model.cfg.vocab_size, (3 * PAGE + 5,), generator=g).tolist()
    serve(model, kv, "a", doc, 0)
    kv.release("a")
    tokens = doc[:cached_pages * PAGE] + torch.randint(0, model.cfg.vocab_size, (PAGE,), generator=g).tolist()
    n = kv.admit("b", len(tokens) + 1, tokens[:-1])
    slot = kv.slot_of["b"]
    assert n == cached_pages * PAGE
    assert (int(kv.win_lo[slot]), int(kv.win_len[slot])) == (max(0, n - 32), n)


def test_stores_cache_nothing_unless_asked(model) -> None:
    """Prefix caching is opt-in: a store built without it frees a finished request's full pages instead of
    caching them."""
    cfg = model.cfg
    ps = documents(model, 1, 60, 1, seed=5)
    for kv in (HiSparseKV(cfg, "fp8_ds_mla", host_pool_gib=gib(cfg, 14), hot_buffer_tokens=16, resident_window=8,
                          page_tokens=PAGE),
               ResidentKV(cfg, "fp8_ds_mla", budget_tokens=14 * PAGE, page_tokens=PAGE)):
        run_waves(model, kv, [ps])
        assert not kv.prefix_caching and kv.cached_pages() == 0 and kv.pages.pages_used == 0
