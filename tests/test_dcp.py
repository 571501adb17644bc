"""Decode context parallelism (spec §7) on real processes (gloo): R ranks, each with its own HiSparse store,
give the single-rank selections and logits; a dead or hung rank fails the run with a clear error.

One spawn of 4 ranks covers R = 1..4 (subgroups of its first R ranks) and I = 1, 2: prefill, chunked prefill
batched with decode, batched decode, and 32 greedy tokens, on the tiny preset (every layer kind: KV consumer 7,
indexer sharers 2, 5, 6), with a hot buffer and resident window much smaller than the context. Exactness is
checked in fp64 on a sharpened model (peaky softmaxes, so a wrong row or weight shows). The fp32 tolerance is
checked on the spec-init model (the sharpened one is too ill-conditioned for fp32: its own fp32 and fp64 logits
differ by O(1)) with unquantised rows: with fp8/bf16 rows a 1-ulp fp32 difference in a latent can flip the
rounding of a stored element, a jump no reassociation tolerance covers (measured: ~2e-5 with bf16 rows).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from conftest import SEED, tiny_model
from hisparse.parallel.context import DCPContext
from hisparse.parallel.group import GroupError, RankGroup
from hisparse.parallel.sharded_kv import ShardedKV
from hisparse.parallel.launch import DCPLaunchError, launch
from hisparse.parallel.sharding import Sharding
from hisparse.engine.generate import greedy_generate
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.core.batch import ForwardTrace, Segment
from hisparse.kv.base import LatentKV
from hisparse.kv.resident import ResidentKV

pytestmark = pytest.mark.usefixtures("single_thread")

SIZES, INTERLEAVES = (1, 2, 3, 4), (1, 2)
GREEDY = 32


def hisparse_kv(model, index_cache: str = "fp32", resident_pages: int | None = None) -> HiSparseKV:
    """A store whose device working set (2 sinks + 4-token window + 4 hot slots) is far below the context;
    resident_pages: hybrid, with that many device pages (fewer than the scenario's, so some spill)."""
    geometry = dict(host_pool_gib=0.002, hot_buffer_tokens=4, resident_window=4, sink_tokens=2, page_tokens=8)
    gib = None     # (the scenario runs two requests at once: their working sets, and the pages beside them)
    if resident_pages is not None:
        gib = HiSparseKV(model.cfg, "fp8_ds_mla", **geometry).budget_gib(2, resident_pages)
    return HiSparseKV(model.cfg, "fp8_ds_mla", dtype=model.dtype, index_cache=index_cache, device_kv_gib=gib,
                      **geometry)


def scenario(model, kv: LatentKV, seed: int, greedy: int = GREEDY) -> dict:
    """The same steps on any store: logits and every layer's selections of each forward, and greedy tokens."""
    V = model.cfg.vocab_size
    toks = torch.randperm(V, generator=torch.Generator().manual_seed(seed))   # distinct: no bit-identical keys
    a, b, c = toks[:97], toks[97:144], toks[144:168]
    out = {"logits": [], "selections": []}

    def step(tokens: torch.Tensor, segs: list[Segment]) -> torch.Tensor:
        trace = ForwardTrace()
        logits = model(tokens, segs, kv, trace=trace)
        out["logits"].append(logits)
        out["selections"].append(trace.selections)
        return logits

    step(a[:96], [Segment("a", 0, 96)])                  # prefill, one chunk (R <= 2: the fused top-k kernel)
    nxt_a = a[96]
    for start, n in ((0, 1), (1, 12), (13, 23)):                               # chunked prefill of b ...
        lg = step(torch.cat((nxt_a[None], b[start:start + n])),                # ... batched with decode of a
                  [Segment("a", 96 + (start > 0) + (start > 1), 1), Segment("b", start, n)])
        nxt_a = lg[0].argmax()
    pos = {"a": 99, "b": 36}
    for _ in range(6):                                                         # batched decode
        lg = step(torch.stack((nxt_a, lg[-1].argmax())), [Segment("a", pos["a"], 1), Segment("b", pos["b"], 1)])
        nxt_a = lg[0].argmax()
        pos = {r: p + 1 for r, p in pos.items()}
    store = kv.inner if isinstance(kv, ShardedKV) else kv
    out["pages"] = store.pool.pages_used if isinstance(store, HiSparseKV) else None   # a: 105 tokens, b: 42
    kv.release("a")
    kv.release("b")
    if greedy:
        out["greedy"] = greedy_generate(model, kv, c.tolist(), greedy, chunk=10, req="c").tokens
    out["misses"], out["spilled"] = kv.stats.misses, store.stats.spilled_pages
    return out


def models(seed: int) -> dict:
    fp64 = tiny_model(seed)
    return {"fp64": fp64, "fp32": tiny_model(seed, torch.float32, sharp=False), "fp8_keys": fp64, "hybrid": fp64}


def stores(models: dict) -> dict:
    """fp64: HiSparse with fp8 rows; fp32: exact rows (see the module docstring); fp8_keys: fp64's store with
    132-B fp8 indexer-key records (each rank holds its own positions' records); hybrid: fp64's store with 3
    resident pages per rank (b's first chunk, one token, holds no page on ranks > 0)."""
    return {"fp64": hisparse_kv(models["fp64"]), "fp32": ResidentKV(models["fp32"].cfg, None, dtype=torch.float32),
            "fp8_keys": hisparse_kv(models["fp8_keys"], index_cache="fp8"),
            "hybrid": hisparse_kv(models["hybrid"], resident_pages=3)}


def run_all(models: dict, wrap, seed: int) -> dict:
    """fp64, fp8_keys: the whole scenario; fp32: without the greedy part. wrap: store -> the store the model
    runs on."""
    kvs = stores(models)
    return {name: scenario(m, wrap(kvs[name]), seed, 0 if name == "fp32" else GREEDY) for name, m in models.items()}


def rank_main(group: RankGroup, seed: int) -> dict:
    """Every rank: for R = 1..4, ranks < R form a DCP group and run the scenarios with I = 1 and 2."""
    ms = models(seed)
    results = {}
    for size in SIZES:
        pg = dist.new_group(list(range(size)), timeout=dist.default_pg_timeout)   # every rank must call it
        if group.rank < size:
            for interleave in INTERLEAVES:
                dcp = DCPContext(RankGroup(pg, group.timeout_s), interleave)
                results[(size, interleave)] = run_all(ms, lambda kv: ShardedKV(kv, dcp), seed)
                results[(size, interleave)]["capacity"] = fill_to_capacity(ms["fp64"], dcp)
    return results


def fill_to_capacity(model, dcp: DCPContext, pages: int = 12) -> dict:
    """Reserve a request of the whole global capacity, refuse one more token, allocate it on this rank's pool."""
    page_bytes = 8 * 56 * len(model.cfg.kv_owner_layers)              # 8-token pages of 56-B tiny fp8 rows
    kv = ShardedKV(HiSparseKV(model.cfg, "fp8_ds_mla", dtype=model.dtype, host_pool_gib=pages * page_bytes / 2**30,
                              page_tokens=8), dcp)
    cap = kv.token_capacity()
    ok, more = kv.reserve("x", cap), kv.reserve("y", 1)
    kv.begin_step([Segment("x", 0, cap)])        # allocates this rank's share: must not exhaust the pool
    kv.end_step()
    return {"capacity": cap, "reserved": ok, "refused_more": not more, "pages_used": kv.inner.pool.pages_used,
            "pages": kv.inner.pool.n_pages, "usage": kv.usage_ratio()}


@pytest.fixture(scope="module")
def dcp_runs() -> tuple[dict, list[dict]]:
    """(single-rank reference, each rank's results)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)             # as the ranks: R = 1 must then be bit-identical
    ref = run_all(models(SEED), lambda kv: kv, SEED)
    torch.set_num_threads(threads)
    ranks = launch(rank_main, max(SIZES), SEED, threads=1, timeout_s=60.0, deadline_s=600.0)
    return ref, ranks


def rel_error(ref: dict, got: dict) -> float:
    """Max over every forward of max |logit error| / max |logit|."""
    return max(float((h - w).abs().max() / w.abs().max()) for w, h in zip(ref["logits"], got["logits"], strict=True))


def owners_without_selection(sel: torch.Tensor, sh: Sharding) -> int:
    """(query, rank) pairs where the rank owns none of the query's selected positions."""
    valid = sel >= 0
    owner = sh.owner(sel.clamp(min=0))
    owns = torch.stack([(valid & (owner == r)).any(1) for r in range(sh.size)], 1)
    return int((~owns).sum())


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("interleave", INTERLEAVES)
def test_dcp_matches_single_rank(dcp_runs, size: int, interleave: int):
    refs, ranks = dcp_runs
    ref, got = refs["fp64"], ranks[0][(size, interleave)]["fp64"]
    # every layer's Sel(t) equals the single-rank one (same positions, same ascending order) in every forward
    empty_shards = 0
    for step, (want, have) in enumerate(zip(ref["selections"], got["selections"], strict=True)):
        assert sorted(have) == sorted(want) == [0, 1, 2, 3, 4, 5, 6, 7]      # owners, sharers, consumer
        for layer in want:
            for w, h in zip(want[layer], have[layer], strict=True):
                assert torch.equal(w, h), f"step {step} layer {layer}: selection differs"
                empty_shards += owners_without_selection(w, Sharding(size, interleave, 0))
    assert size == 1 or empty_shards > 0          # the scenario has queries some shard contributes nothing to
    # logits: R = 1 is the single-rank computation bit for bit; otherwise within reassociation error
    err = rel_error(ref, got)
    err32 = rel_error(refs["fp32"], ranks[0][(size, interleave)]["fp32"])
    print(f"R={size} I={interleave}: max relative logit error fp64 {err:.2e}, fp32 {err32:.2e}")
    assert err == 0.0 if size == 1 else err < 1e-12
    assert err32 == 0.0 if size == 1 else err32 < 1e-5
    assert got["greedy"] == ref["greedy"] and len(got["greedy"]) == GREEDY
    # fp8 indexer keys: the single-rank selections and greedy tokens (logits within reassociation error)
    ref8, got8 = refs["fp8_keys"], ranks[0][(size, interleave)]["fp8_keys"]
    for want, have in zip(ref8["selections"], got8["selections"], strict=True):
        assert all(torch.equal(w, h) for layer in want for w, h in zip(want[layer], have[layer], strict=True))
    assert rel_error(ref8, got8) == 0.0 if size == 1 else rel_error(ref8, got8) < 1e-12
    assert got8["greedy"] == ref8["greedy"] and len(got8["greedy"]) == GREEDY
    assert any(not torch.equal(w, h) for a, b in zip(ref["selections"], ref8["selections"], strict=True)
               for layer in a for w, h in zip(a[layer], b[layer], strict=True))    # the fp8 keys really scored
    # hybrid (resident pages, some spilled): the single-rank selections and greedy tokens
    refh, goth = refs["hybrid"], ranks[0][(size, interleave)]["hybrid"]
    for want, have in zip(refh["selections"], goth["selections"], strict=True):
        assert all(torch.equal(w, h) for layer in want for w, h in zip(want[layer], have[layer], strict=True))
    assert rel_error(refh, goth) == 0.0 if size == 1 else rel_error(refh, goth) < 1e-12
    assert goth["greedy"] == refh["greedy"] == ref["greedy"] and goth["spilled"] > 0
    # every rank computed the same logits (hidden states stay replicated) and really used its host pool
    for r in range(size):
        for name in ("fp64", "fp32"):
            mine = ranks[r][(size, interleave)][name]
            theirs = ranks[0][(size, interleave)][name]
            assert all(torch.equal(x, y) for x, y in zip(mine["logits"], theirs["logits"], strict=True))
            assert name == "fp32" or mine["misses"] > 0
        # rank r's pool holds exactly its own positions, densely (8-token pages): a 105 tokens, b 42 tokens
        sh = Sharding(size, interleave, r)
        assert ranks[r][(size, interleave)]["fp64"]["pages"] == sum(-(-sh.count_owned(n) // 8) for n in (105, 42))
        # capacity in global tokens: rank 0 (the most loaded) fills its 12 pages exactly, no pool overflows
        cap = ranks[r][(size, interleave)]["capacity"]
        assert cap["capacity"] == size * 12 * 8 and cap["pages"] == 12              # R times one rank's pool
        assert cap["reserved"] and cap["refused_more"] and cap["usage"] == 1.0
        assert cap["pages_used"] == (12 if r == 0 else -(-sh.count_owned(cap["capacity"]) // 8))
    assert ref["pages"] == 14 + 6


def failing_rank(group: RankGroup, seed: int, mode: str) -> None:
    """One warm-up forward on 2 ranks; then rank 1 dies (SIGKILL) or hangs while rank 0 runs another one."""
    model = tiny_model(seed)
    kv = ShardedKV(hisparse_kv(model), DCPContext(group, 1))
    prompt = torch.arange(20)
    model(prompt, [Segment(0, 0, 20)], kv)
    if group.rank == 1:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    model(torch.tensor([5]), [Segment(0, 20, 1)], kv)
    raise AssertionError("rank 0's forward returned although its peer was gone")


@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_dead_or_hung_rank_fails_cleanly(mode: str):
    timeout = 2.0
    t0 = time.monotonic()
    # kill: rank 1 fails first, and rank 0 (whose next collective fails at once) may be slow to get there on a
    # loaded machine, so it gets a long grace; hang: rank 0 fails first, and the sleeping rank 1 is killed after
    # the default grace (timeout + 1 s)
    with pytest.raises(DCPLaunchError) as info:
        launch(failing_rank, 2, SEED, mode, threads=1, timeout_s=timeout, deadline_s=120,
               grace_s=30.0 if mode == "kill" else None)
    elapsed = time.monotonic() - t0
    errors = info.value.errors
    print(f"{mode}: failed after {elapsed:.1f} s: {str(info.value).splitlines()[0]}")
    assert GroupError.__name__ in errors[0] and "all_gather for layer 0 indexer top-k failed" in errors[0]
    assert "peer rank died" in str(info.value)
    if mode == "kill":
        assert "killed by signal SIGKILL" in errors[1]
    else:
        assert "timed out" in errors[0].lower() or "timeout" in errors[0].lower()
        assert "killed by the launcher" in errors[1]
    assert elapsed < 60
    assert not multiprocessing.active_children()                 # no rank process left behind


def test_sharding_math():
    """owner/local/global_of/count_owned against a direct enumeration (spec §7 formulas)."""
    for R in range(1, 6):
        for I in range(1, 4):
            n = 3 * R * I + 5
            p = torch.arange(n)
            for r in range(R):
                sh = Sharding(R, I, r)
                mine = p[(p // I) % R == r]                                  # owner(p) = floor(p/I) mod R
                assert torch.equal(sh.owner(p) == r, (p // I) % R == r)
                assert torch.equal(sh.local(mine), torch.arange(len(mine)))   # dense local indices, in order
                assert torch.equal(sh.global_of(torch.arange(len(mine))), mine)
                for m in range(n + 1):
                    assert sh.count_owned(m) == int(((p[:m] // I) % R == r).sum())
                    assert sh.count_owned(m) <= sh.most_loaded(m)
                for cap in range(len(mine)):                                 # span_of: longest context that fits
                    span = sh.span_of(cap)
                    assert sh.most_loaded(span) <= cap < sh.most_loaded(span + 1)
    with pytest.raises(ValueError, match="dcp_interleave"):
        Sharding(2, 0, 0)
    with pytest.raises(ValueError, match="dcp rank"):
        Sharding(2, 1, 2)


def triton_rank(group: RankGroup, seed: int) -> dict:
    """A 60-token prefill on this rank's shard (Triton store), then Sel(t) of random decode-style queries for every
    indexer layer with the store's Triton scorer and with its torch scorer, over the same stored keys."""
    model = tiny_model(seed, torch.float32, sharp=False)
    tokens = torch.randperm(model.cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[:60]
    kv = ShardedKV(HiSparseKV(model.cfg, "fp8_ds_mla", dtype=model.dtype, host_pool_gib=0.002, hot_buffer_tokens=4,
                              resident_window=4, sink_tokens=2, page_tokens=8, kernels="triton"), DCPContext(group, 1))
    model(tokens, [Segment(0, 0, 60)], kv)
    g = torch.Generator().manual_seed(seed + 1)
    positions, seg = torch.tensor([20, 41, 59]), torch.zeros(3, dtype=torch.long)
    kv.begin_step([Segment(0, 59, 1)])        # the step tables the scorers read (no row is written)
    from hisparse.kv.kernels import indexer_triton
    scorer, calls = indexer_triton.paged_topk_triton, []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("with_scores", args[-1] if len(args) > 9 else False))
        return scorer(*args, **kwargs)
    indexer_triton.paged_topk_triton = counted
    out = {}
    for block in model.layers:
        indexer = block.attention.indexer
        if indexer is None:
            continue
        q = torch.randn(3, indexer.n_heads, indexer.head_dim, generator=g)
        w = torch.randn(3, indexer.n_heads, generator=g)
        for kernels in ("triton", "torch"):
            kv.inner.kernels = kernels
            out[(block.spec.index, kernels)] = kv.select(block.spec.index, indexer, q, w, seg, positions)
        kv.inner.kernels = "triton"
    indexer_triton.paged_topk_triton = scorer
    kv.end_step()
    out["triton_calls"] = calls           # the Triton scorer really ran, for the candidates with their scores
    return out


def test_dcp_with_triton_kernels_selects_as_the_torch_path(seed: int) -> None:
    """Under DCP each rank's local top-k (candidates with their scores) comes from the Triton indexer when the
    store's kernels are Triton (interpreted here): over the same stored keys, the merged Sel(t) of every indexer
    layer equals the torch scorer's, on every rank."""
    ranks = launch(triton_rank, 2, seed, threads=1, timeout_s=60.0, deadline_s=600.0)
    for out in ranks:
        calls = out.pop("triton_calls")
        layers = {l for l, _ in out}
        assert calls == [True] * len(layers)
        assert len(layers) >= 2
        for l in layers:
            assert torch.equal(out[(l, "triton")], out[(l, "torch")]), f"layer {l}"
            assert (out[(l, "torch")] >= 0).sum() > 0
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])     # every rank merges the same Sel(t)
