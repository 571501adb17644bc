"""The fp8 indexer cache (spec §4): 132-B records per token per indexer layer, the power-of-two quantiser, and
selections from the records equal to a naive quantise/dequantise/score reference."""

from __future__ import annotations

import math

import pytest
import torch

from hisparse.kv.settings import KVSettings, KVSettingsError
from hisparse.core.batch import Segment
from hisparse.core.config import preset, preset_params
from hisparse.kv.index_cache import IndexKeyStore, dequantise, key_bytes, quantise
from hisparse.kv.scoring import FUSED_MIN_PAIRS
from hisparse.model.indexer import Indexer
from hisparse.kv.kernels import indexer_topk
from hisparse.kv.resident import ResidentKV
from hisparse.model.tiny import random_model


def naive_dequantised(keys: torch.Tensor) -> torch.Tensor:
    """Spec §4 written out per key in plain Python: s = 2^ceil(log2(max(amax, 1e-4) / 448)), e4m3(k / s) * s."""
    out = torch.empty(keys.shape, dtype=torch.float64)
    for i, k in enumerate(keys.double()):
        s = 2.0 ** math.ceil(math.log2(max(float(k.abs().max()), 1e-4) / 448.0))
        out[i] = (k / s).float().to(torch.float8_e4m3fn).double() * s
    return out


def naive_topk(q: torch.Tensor, wr: torch.Tensor, keys: torch.Tensor, n_visible: int, k: int) -> list[int]:
    """fp64 scores sum_h wr relu(<q_h, key>) over keys 0..n_visible-1; top-k by (score desc, position asc)."""
    scores = (wr.double()[:, None] * torch.relu(q.double() @ keys[:n_visible].double().T)).sum(0)
    order = sorted(range(n_visible), key=lambda s: (-float(scores[s]), s))
    return sorted(order[:k])


def test_quantiser_follows_the_spec():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(64, 128, generator=g) * torch.logspace(-6, 3, 64)[:, None]
    keys[0] = 0.0                                   # amax floor: a finite scale
    keys[1, 0] = 448.0 * 2.0 ** -3                  # amax / 448 exactly a power of two: that power, not the next
    keys[1, 1:] = keys[1, 1:].clamp(-1e-3, 1e-3)
    rec = quantise(keys)
    assert rec.shape == (64, 132) and rec.dtype == torch.uint8
    scale = rec[:, 128:].contiguous().view(torch.float32).squeeze(1)
    mant, _ = torch.frexp(scale)
    assert (mant == 0.5).all()                                              # powers of two
    amax = keys.abs().amax(1).clamp_min(1e-4)
    assert (amax / scale <= 448).all() and (amax / (scale / 2) > 448).all()  # the smallest that fits
    assert scale[1] == 2.0 ** -3
    deq = dequantise(rec, torch.float64)
    assert torch.equal(deq, naive_dequantised(keys))
    assert torch.equal(dequantise(rec, torch.float32).double(), deq)        # exact in fp32 and bf16 too
    assert torch.equal(dequantise(rec, torch.bfloat16).double(), deq)
    rel = ((deq - keys.double()).abs().amax(1) / keys.double().abs().amax(1).clamp_min(1e-30))[1:]
    assert (rel <= 2.0 ** -4).all()                                          # e4m3's half-ulp at the row maximum


def test_device_bytes_per_token_per_indexer_layer_is_132():
    """Full size (dI = 128): 132 B with fp8, 512 B with fp32; a tiny store holds exactly dI + 4 B per key."""
    cfg = preset("full")
    fp8 = IndexKeyStore(cfg.index_owner_layers, cfg.index_head_dim, "fp8", torch.float32, torch.device("cpu"), 64)
    fp32 = IndexKeyStore(cfg.index_owner_layers, cfg.index_head_dim, "fp32", torch.float32, torch.device("cpu"), 64)
    assert fp8.bytes_per_token_layer() == key_bytes(128, "fp8") == 132
    assert fp32.bytes_per_token_layer() == key_bytes(128, "fp32") == 512
    assert fp8.bytes_per_page() == 64 * 132 * 44 and 132 * 44 == 5808          # spec §4: 5,808 B per token
    model = random_model(preset_params("tiny"), seed=1)
    for offload in ("none", "hisparse"):
        kv = KVSettings(offload=offload, index_cache="fp8", host_pool_gib=0.01, page_tokens=16).build(model.cfg)
        model(torch.arange(40), [Segment(0, 0, 40)], kv)
        dI, layers = model.cfg.index_head_dim, len(model.cfg.index_owner_layers)
        assert all(t.dtype == torch.uint8 and t.shape[1] == dI + 4 for t in kv.index_keys.data.values())
        assert kv.index_cache_bytes() == kv.pages.pages_used * 16 * (dI + 4) * layers > 0


def test_index_cache_setting_is_validated():
    with pytest.raises(KVSettingsError, match="index_cache"):
        KVSettings(index_cache="fp16")
    with pytest.raises(KVSettingsError, match="'index_cache'"):
        KVSettings.from_extra_config({"host_pool_gib": 1, "index_cache": "int8"})
    assert KVSettings.from_extra_config({"host_pool_gib": 1, "index_cache": "fp8"}).index_cache == "fp8"


@pytest.mark.parametrize("context", [23, 300])   # torch path; the fused CPU kernel (n x L >= FUSED_MIN_PAIRS)
def test_selections_from_fp8_records_equal_the_naive_reference(context):
    """Two requests' keys in one paged store: every query row's top-k from the records equals fp64 scoring of the
    naively quantised/dequantised keys, and differs from the exact keys' top-k somewhere."""
    cfg = preset("tiny")
    HI, dI, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    layer = cfg.index_owner_layers[0]
    indexer = Indexer(cfg, cfg.layers[layer]).double()
    g = torch.Generator().manual_seed(context)
    lens = [context, context - 7]
    keys = [torch.randn(n, dI, generator=g, dtype=torch.float64) * torch.rand(n, 1, generator=g, dtype=torch.float64)
            for n in lens]
    n_q = 20 if context > 100 else 6
    q = torch.randn(2 * n_q, HI, dI, generator=g, dtype=torch.float64)
    w = torch.randn(2 * n_q, HI, generator=g, dtype=torch.float64)
    seg = torch.arange(2).repeat_interleave(n_q)
    pos = torch.cat([torch.arange(n - n_q, n) for n in lens])
    if context > 100:
        assert len(pos) * context >= FUSED_MIN_PAIRS and indexer_topk.available()
    sels = {}
    for form in ("fp8", "fp32"):
        kv = ResidentKV(cfg, "fp8_ds_mla", dtype=torch.float64, page_tokens=8, index_cache=form)
        kv.begin_step([Segment("a", 0, lens[0]), Segment("b", 0, lens[1])])
        kv.write_keys(layer, torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]),
                      torch.cat([torch.arange(n) for n in lens]), torch.cat(keys))
        sels[form] = kv.select(layer, indexer, q, w, seg, pos)
    wr = indexer.head_weights(w)
    deq = [naive_dequantised(kk) for kk in keys]
    for t in range(len(pos)):
        want = naive_topk(q[t], wr[t], deq[seg[t]], int(pos[t]) + 1, k)
        got = sels["fp8"][t]
        assert got[got >= 0].tolist() == want, f"row {t}"
    assert not torch.equal(sels["fp8"], sels["fp32"])


@pytest.mark.parametrize("context", [23, 300])   # torch path; the fused CPU kernel
def test_bf16_store_scores_as_the_fp32_store(context):
    """A bf16 model's index cache (fp8 records, or bf16 keys) selects what an fp32 store of the same keys selects
    for the same queries: bf16 queries, head weights and keys are scored in fp32 (`score_dtype`), and the records
    (quantised from the keys' fp32 values) decode exactly into fp32."""
    cfg = preset("tiny")
    HI, dI = cfg.index_n_heads, cfg.index_head_dim
    layer = cfg.index_owner_layers[0]
    indexer = Indexer(cfg, cfg.layers[layer])
    g = torch.Generator().manual_seed(context)
    keys = (torch.randn(context, dI, generator=g) * torch.rand(context, 1, generator=g)).bfloat16()
    keys[1::4] = keys[0::4][: keys[1::4].shape[0]]                 # exact ties
    n_q = 20
    q = torch.randn(n_q, HI, dI, generator=g).bfloat16()
    w = torch.randn(n_q, HI, generator=g).bfloat16()
    seg, pos = torch.zeros(n_q, dtype=torch.long), torch.arange(context - n_q, context)
    for form in ("fp8", "fp32"):
        sels = []
        for dtype in (torch.bfloat16, torch.float32):
            kv = ResidentKV(cfg, "fp8_ds_mla", dtype=dtype, page_tokens=8, index_cache=form)
            kv.begin_step([Segment("a", 0, context)])
            kv.write_keys(layer, torch.zeros(context, dtype=torch.long), torch.arange(context), keys.to(dtype))
            sels.append(kv.select(layer, indexer, q.to(dtype), w.to(dtype), seg, pos))
        assert torch.equal(sels[0], sels[1]), form


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_kernel_reads_records_as_their_dequantised_keys(dtype):
    """The fused CPU kernel over fp8 records (decoded as it gathers them) returns the columns and score bits it
    returns over the dequantised keys: full-size dI = 128, several requests' pages interleaved in one store.
    The kernel builds wherever the suite runs (tests/test_indexer_kernel.py calls it unconditionally too)."""
    assert indexer_topk.available(), "the CPU indexer kernel did not build"
    g = torch.Generator().manual_seed(3)
    HI, dI, P, n_seg, pages = 4, 128, 16, 3, 5
    n = n_seg * pages * P
    keys = torch.randn(n, dI, generator=g, dtype=dtype) * 10.0 ** torch.randint(-3, 3, (n, 1), generator=g)
    rec = quantise(keys)
    table = torch.randperm(n_seg * pages, generator=g).view(n_seg, pages)
    q = torch.randn(12, HI, dI, generator=g, dtype=dtype)
    wr = torch.rand(12, HI, generator=g, dtype=dtype) - 0.3
    row_seg = torch.arange(n_seg).repeat_interleave(4)
    n_visible = torch.randint(1, pages * P + 1, (12,), generator=g)
    assert indexer_topk.supports(q, wr, rec)
    for k in (8, 100):
        got = indexer_topk.fused_topk_paged(q, wr, rec, table, P, row_seg, n_visible, k, with_scores=True)
        want = indexer_topk.fused_topk_paged(q, wr, dequantise(rec, dtype), table, P, row_seg, n_visible, k,
                                             with_scores=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="fp8 records"):
        indexer_topk.fused_topk_paged(q, wr, rec[:, :-4], table, P, row_seg, n_visible, 8)
