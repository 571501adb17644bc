"""HiSparseKV end to end: bit-identical to ResidentKV, pool accounting, exhaustion, geometry."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hisparse.engine.generate import greedy_generate
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.host_pool.pool import HostPool, PoolExhausted
from hisparse.core.batch import Segment
from hisparse.core.config import preset, preset_params
from hisparse.kv.geometry import geometry, row_layout
from hisparse.kv.resident import ResidentKV
from hisparse.model.tiny import random_model


@pytest.fixture(scope="module")
def model():
    p = preset_params("tiny")
    p["max_position_embeddings"] = 1 << 16
    return random_model(p, seed=int(torch.randint(0, 10_000, ()).item()))


def small_hisparse(cfg, layout, **kw):
    args = dict(host_pool_gib=0.002, hot_buffer_tokens=16, resident_window=8, page_tokens=16)
    args.update(kw)
    return HiSparseKV(cfg, layout, **args)


@pytest.mark.parametrize(("layout", "index_cache"), [("fp8_ds_mla", "fp32"), ("bf16", "fp32"), ("fp8_ds_mla", "fp8")])
def test_on_equals_off_bit_identical(model, layout, index_cache):
    """A prompt ~15x the hot buffer, 64 greedy tokens: same tokens and bit-identical logits (either index cache)."""
    prompt = torch.randint(0, model.cfg.vocab_size, (240,)).tolist()
    off = greedy_generate(model, ResidentKV(model.cfg, layout, index_cache=index_cache), prompt, 64, chunk=53,
                          keep_logits=True)
    kv = small_hisparse(model.cfg, layout, index_cache=index_cache)
    on = greedy_generate(model, kv, prompt, 64, chunk=53, keep_logits=True)
    assert on.tokens == off.tokens
    assert all(torch.equal(a, b) for a, b in zip(on.logits, off.logits))
    s = kv.stats
    assert s.misses > 1000 and s.hits > 0 and s.overlapped_copies > 0     # the host pool really served rows
    assert s.host_to_device_bytes == s.misses * row_layout(model.cfg, layout).row_bytes
    assert kv.pool.pages_used == 0 and not kv.slot_of and all((h.pos[:-1] < 0).all() for h in kv.hot.values())


def test_batched_requests_match_resident(model):
    """Two requests interleaved in one forward per step (plus a sharer/consumer-heavy config) match."""
    cfg = model.cfg
    kvs = [ResidentKV(cfg, "fp8_ds_mla"), small_hisparse(cfg, "fp8_ds_mla")]
    prompts = [torch.randint(0, cfg.vocab_size, (n,)) for n in (90, 61)]
    outs = []
    for kv in kvs:
        logits = []
        for s in range(0, 90, 30):   # chunked prefill of both requests in one batch
            segs, toks = [], []
            for r, p in enumerate(prompts):
                if s < len(p):
                    n = min(30, len(p) - s)
                    segs.append(Segment(r, s, n))
                    toks.append(p[s:s + n])
            logits.append(model(torch.cat(toks), segs, kv))
        pos = [len(p) for p in prompts]
        for _ in range(20):          # decode both requests together
            nxt = logits[-1].argmax(-1)[-2:] if len(logits[-1]) >= 2 else None
            toks = torch.stack([nxt[0], nxt[1]])
            logits.append(model(toks, [Segment(0, pos[0], 1), Segment(1, pos[1], 1)], kv))
            pos = [q + 1 for q in pos]
        outs.append(logits)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_resident_positions_never_take_a_slot(model):
    kv = small_hisparse(model.cfg, "bf16", sink_tokens=4)
    prompt = torch.randint(0, model.cfg.vocab_size, (120,)).tolist()
    from hisparse.engine.generate import prefill
    prefill(model, kv, "r", prompt, chunk=17)
    slot = kv.slot_of["r"]
    lo = int(kv.win_lo[slot])
    for hot in kv.hot.values():
        held = hot.held(slot)
        assert held.numel() > 0 and bool(((held >= 4) & (held < lo)).all())
    kv.release("r")


def test_cancel_and_finish_return_pool_to_baseline(model):
    kv = small_hisparse(model.cfg, "fp8_ds_mla")
    base = kv.pool.pages_used
    from hisparse.engine.generate import prefill
    assert kv.reserve("a", 200)
    prefill(model, kv, "a", torch.randint(0, 512, (100,)).tolist(), chunk=40)   # "cancelled" mid-request
    assert kv.pool.pages_used > base and kv.usage_ratio() > 0
    kv.release("a")
    assert kv.pool.pages_used == base and kv.usage_ratio() == 0 and kv.index_cache_bytes() == 0


def test_exhaustion_is_named_and_leaves_others_untouched(model):
    cfg = model.cfg
    kv = small_hisparse(cfg, "fp8_ds_mla", host_pool_gib=16 * 7 * 56 * 12 / 2**30)   # exactly 12 pages
    assert kv.pool.n_pages == 12
    prompt_a = torch.randint(0, 512, (100,)).tolist()
    from hisparse.engine.generate import prefill
    ref = greedy_generate(model, ResidentKV(cfg, "fp8_ds_mla"), prompt_a, 10, chunk=50).tokens
    prefill(model, kv, "a", prompt_a[:50], chunk=50)                # a holds 4 pages
    with pytest.raises(PoolExhausted, match="host pool exhausted"):
        prefill(model, kv, "b", torch.randint(0, 512, (200,)).tolist(), chunk=200)   # needs 13 pages
    assert "b" not in kv.pool.tables and kv.pool.pages_used == 4
    kv.release("b")
    # a continues unharmed and gives the same tokens as an all-resident run
    logits = prefill(model, kv, "a", prompt_a, chunk=50, start=50)
    toks, pos = [], len(prompt_a)
    for _ in range(10):
        toks.append(int(logits.argmax()))
        logits = model(torch.tensor([toks[-1]]), [Segment("a", pos, 1)], kv)[0]
        pos += 1
    assert toks == ref


def test_reservation_admission(model):
    kv = small_hisparse(model.cfg, "fp8_ds_mla", host_pool_gib=16 * 7 * 56 * 12 / 2**30)
    assert kv.token_capacity() == 12 * 16
    assert kv.reserve("a", 100)            # 7 pages
    assert not kv.reserve("b", 100)        # 7 more do not fit now
    assert kv.can_ever_admit(150) and not kv.can_ever_admit(12 * 16 + 1)
    kv.release("a")
    assert kv.reserve("b", 100)


def test_a_pool_of_exactly_one_page_works_and_less_is_refused():
    cfg = preset("full")
    layout = row_layout(cfg, "fp8_ds_mla")
    page_bytes = HostPool(layout, cfg.kv_source_layers, host_pool_gib=0.01, page_tokens=16, pin=False).page_bytes
    one = HostPool(layout, cfg.kv_source_layers, host_pool_gib=page_bytes / (1 << 30), page_tokens=16, pin=False)
    one.ensure("r", 16)
    assert one.token_capacity == 16 and one.pages_used == 1
    with pytest.raises(ValueError, match="host_pool_gib: .* holds no page"):
        HostPool(layout, cfg.kv_source_layers, host_pool_gib=(page_bytes - 1) / (1 << 30), page_tokens=16, pin=False)


def test_full_geometry_and_consumer_binding():
    cfg = preset("full")
    g = geometry(cfg)
    assert (g.row_bytes, g.latent_bytes_per_token, g.total_bytes_per_token) == (656, 41_328, 47_136)
    assert abs(g.sharing_gain - (72 / 63 - 1)) < 1e-12
    pool = HostPool(row_layout(cfg, "fp8_ds_mla"), cfg.kv_source_layers, host_pool_gib=0.1, page_tokens=64, pin=False)
    assert pool.page_bytes / pool.page_tokens == 41_328                     # row size x KV-owning layers
    assert pool.buffer.shape[0] == 63                                       # consumers cost zero bytes
    n_pages = pool.token_capacity // 64
    assert pool.metadata_bytes() == 8 * n_pages                             # one page-table entry per page
    pool.ensure("r", pool.token_capacity // 2)
    assert pool.metadata_bytes() == 8 * n_pages and pool.metadata_bytes() / pool.nbytes < 0.005
    for consumer in (39, 43, 71):                                           # bound to layer 35's rows
        assert pool.layer_view(consumer).data_ptr() == pool.layer_view(35).data_ptr()
    assert pool.layer_view(36).data_ptr() != pool.layer_view(35).data_ptr()


SEAM = ("write", "write_keys", "select", "gather", "attend")


def counting(base):
    """A LatentKV class that counts its seam calls per step."""
    class Counting(base):
        def begin_step(self, segments):
            super().begin_step(segments)
            self.calls = Counter()

    for name in SEAM:
        def op(self, *a, _name=name, **k):
            self.calls[_name] += 1
            return getattr(base, _name)(self, *a, **k)
        setattr(Counting, name, op)
    return Counting


@pytest.mark.parametrize("base", [ResidentKV, HiSparseKV])
def test_seam_calls_per_layer_do_not_grow_with_the_batch(model, base):
    """A decode step of 1 and of 16 requests makes the same KV seam calls: one per layer and operation."""
    cfg = model.cfg
    counts = []
    for n in (1, 16):
        kv = counting(base)(cfg, "fp8_ds_mla", **({"host_pool_gib": 0.01} if base is HiSparseKV else {}))
        prompts = torch.randint(0, cfg.vocab_size, (n, 20))
        model(prompts.flatten(), [Segment(r, 0, 20) for r in range(n)], kv)
        model(prompts[:, -1], [Segment(r, 20, 1) for r in range(n)], kv)
        counts.append(dict(kv.calls))
    attending = cfg.n_layers
    assert counts[0] == counts[1] == {"write": len(cfg.kv_owner_layers), "write_keys": len(cfg.index_owner_layers),
                                      "select": len(cfg.index_owner_layers), "gather": attending,
                                      "attend": attending}
