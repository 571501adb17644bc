"""The Triton path end to end (`--kernels triton`): HiSparseKV and ResidentKV with the miss-path and sparse MLA
kernels against their torch path on a tiny model, the two stores driven in lockstep by one forward (every layer
of both sees the same rows, keys and queries: tests/lockstep.py). The miss path is exact, so selections, LRU
decisions, hits, misses and copied bytes match the torch path's exactly; attention agrees within fp32 rounding
(fp32 model), or (bf16 model, the CUDA default) is no farther from an fp64 store's than the torch path's is,
within a factor of two. Without CUDA the kernels run under Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from hisparse.engine.generate import greedy_generate
from hisparse.kv.settings import KVSettings, KVSettingsError
from hisparse.kv import hisparse_kv
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.core import triton_support
from hisparse.kv.resident import ResidentKV
from hisparse.model.tiny import random_model
from hisparse.core.config import preset_params

from lockstep import LockstepKV

runnable = triton_support.available() and (torch.cuda.is_available() or triton_support.interpreted())
needs_kernels = pytest.mark.skipif(not runnable, reason="needs triton, and CUDA or the Triton interpreter")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model(seed: int):
    return random_model(preset_params("tiny"), seed=seed % 10_000).to(DEV)


@needs_kernels
@pytest.mark.parametrize(("layout", "index_cache", "dtype"), [("fp8_ds_mla", "fp32", torch.bfloat16),
                                                              ("bf16", "fp32", torch.float32),
                                                              ("fp8_ds_mla", "fp8", torch.float32)],
                         ids=["fp8_ds_mla-fp32-bf16", "bf16-fp32", "fp8_ds_mla-fp8"])
def test_hisparse_triton_equals_torch(model, layout: str, index_cache: str, dtype: torch.dtype, seed: int) -> None:
    """A prompt several times the hot buffer, chunked prefill (transient misses) then greedy decode (fp8 index
    cache: the Triton scorer decodes the records, the torch path dequantises them; same selections). The bf16
    model (serve's defaults on CUDA) stores bf16 indexer keys, scored in fp32 by both paths."""
    prompt = torch.randint(0, model.cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(seed)).tolist()
    model = model if dtype == torch.float32 else random_model(preset_params("tiny"), seed=seed % 10_000).to(DEV, dtype)
    store = lambda kernels, dtype: HiSparseKV(model.cfg, layout, DEV, dtype, host_pool_gib=0.002,  # noqa: E731
                                              hot_buffer_tokens=10, resident_window=6, page_tokens=16,
                                              kernels=kernels, index_cache=index_cache)
    kvs = {k: store(k, dtype) for k in ("torch", "triton")}
    exact = store("torch", torch.float64) if dtype != torch.float32 else None
    lockstep = LockstepKV(kvs["torch"], kvs["triton"], exact=exact)
    greedy_generate(model, lockstep, prompt, 8, chunk=40)
    assert lockstep.compared["attend"] == 10 * len(model.layers)     # 3 prefill chunks + 7 decode steps
    assert lockstep.compared["select"] > 0
    t, r = kvs["triton"].stats, kvs["torch"].stats
    assert (t.hits, t.misses, t.host_to_device_bytes, t.overlapped_copies) == \
        (r.hits, r.misses, r.host_to_device_bytes, r.overlapped_copies)
    assert r.misses > 100      # the host pool really served rows


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hybrid_triton_equals_torch(model, dtype: torch.dtype, seed: int) -> None:
    """Hybrid offload with three resident pages for a six-page context: resident positions read their pages, the
    miss path resolves only the spilled ones; the same rows, and the same hits by kind, as the torch path (bf16:
    attention no farther from an fp64 store's than the torch path's)."""
    prompt = torch.randint(0, model.cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(seed)).tolist()
    model = model if dtype == torch.float32 else random_model(preset_params("tiny"), seed=seed % 10_000).to(DEV, dtype)
    geometry = dict(host_pool_gib=0.002, hot_buffer_tokens=10, resident_window=6, page_tokens=16)
    gib = HiSparseKV(model.cfg, "fp8_ds_mla", **geometry).budget_gib(1, 3)     # one request's working set
    store = lambda kernels, dtype: HiSparseKV(model.cfg, "fp8_ds_mla", DEV, dtype, kernels=kernels,  # noqa: E731
                                              device_kv_gib=gib, **geometry)
    kvs = {k: store(k, dtype) for k in ("torch", "triton")}
    exact = store("torch", torch.float64) if dtype != torch.float32 else None
    lockstep = LockstepKV(kvs["torch"], kvs["triton"], exact=exact)
    greedy_generate(model, lockstep, prompt, 8, chunk=40)
    assert lockstep.compared["attend"] == 10 * len(model.layers)
    t, r = kvs["triton"].stats, kvs["torch"].stats
    assert (t.resident_hits, t.hits, t.misses, t.spilled_pages) == (r.resident_hits, r.hits, r.misses,
                                                                     r.spilled_pages)
    assert r.resident_hits > 0 and r.misses > 0 and r.spilled_pages > 0


@needs_kernels
def test_all_resident_decode_triton_equals_torch(model, seed: int) -> None:
    """A short request whose page stays resident: its decode steps read rows straight from the page region (no
    miss path), and while it has fewer positions than top-k every position is selected, position 0 included."""
    prompt = torch.randint(0, model.cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
    geometry = dict(host_pool_gib=0.002, hot_buffer_tokens=10, resident_window=6, page_tokens=16)
    gib = HiSparseKV(model.cfg, "fp8_ds_mla", **geometry).budget_gib(1, 2)
    kvs = {k: HiSparseKV(model.cfg, "fp8_ds_mla", DEV, kernels=k, device_kv_gib=gib, **geometry)
           for k in ("torch", "triton")}
    decodes = []
    real = HiSparseKV.rows_on_pages

    def recording(self, layer, seg, sel, empty):
        decodes.append(bool((sel == 0).any()))
        return real(self, layer, seg, sel, empty)
    lockstep = LockstepKV(kvs["torch"], kvs["triton"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HiSparseKV, "rows_on_pages", recording)
        greedy_generate(model, lockstep, prompt, 4)
    assert lockstep.compared["attend"] == 4 * len(model.layers) and any(decodes)
    t, r = kvs["triton"].stats, kvs["torch"].stats
    assert t.resident_hits == r.resident_hits > 0 and t.misses == r.misses == 0


@needs_kernels
def test_narrowed_rows_read_their_subset_of_the_plan(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A last layer that shares an earlier layer's selection runs on fewer rows (prefill computes logits for its
    last row only, AttentionBatch.narrow_): it reads the arena rows of its subset of the launched plan. Two hot
    slots for a top-8 selection: steps have transient misses (rows past the arena, read from the step's extra
    rows), which the torch path's plans count."""
    params = preset_params("tiny") | {"kv_source_layers": [0, 1, 2, 3, 4, 5, 6, 3],
                                      "index_source_layers": [0, 1, 1, 3, 4, 4, 4, 4]}
    model = random_model(params, seed=seed % 10_000).to(DEV)
    prompt = torch.randint(0, model.cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(seed)).tolist()
    kvs = {k: HiSparseKV(model.cfg, "fp8_ds_mla", DEV, host_pool_gib=0.002, hot_buffer_tokens=2, resident_window=4,
                         page_tokens=16, kernels=k) for k in ("torch", "triton")}
    transient = []
    real = hisparse_kv.resolve

    def counting(*args, **kwargs):
        plan = real(*args, **kwargs)
        transient.append(plan.n_transient)
        return plan
    monkeypatch.setattr(hisparse_kv, "resolve", counting)
    lockstep = LockstepKV(kvs["torch"], kvs["triton"])
    greedy_generate(model, lockstep, prompt, 3, chunk=30)
    assert lockstep.compared["attend"] > 0
    assert kvs["triton"].stats.misses == kvs["torch"].stats.misses > 0
    assert sum(transient) > 0


class GatherLockstep(LockstepKV):
    """LockstepKV that also compares, after each attention, the two stores' `gather` of its selection (which the
    Triton path's attention does not call) where something is selected."""

    def attend(self, layer: int, q_lat: torch.Tensor, q_rope: torch.Tensor | None, seg: torch.Tensor,
               sel: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.__getattr__("attend")(layer, q_lat, q_rope, seg, sel, scale)
        want, got = (kv.gather(layer, seg, sel)(0, sel.shape[0]) for kv in (self.reference, self.candidate))
        assert torch.equal(got[sel >= 0], want[sel >= 0]), f"layer {layer}"
        self.compared["gather"] += 1
        return out


@needs_kernels
def test_triton_gather_reads_the_stored_rows(model, seed: int) -> None:
    """`gather` on the Triton path (the seam's row read; its attention reads the bytes directly) returns exactly
    the rows ResidentKV holds, transient misses (two hot slots for a top-8 selection) included."""
    prompt = torch.randint(0, model.cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(seed)).tolist()
    resident = ResidentKV(model.cfg, "fp8_ds_mla", page_tokens=16)
    kv = HiSparseKV(model.cfg, "fp8_ds_mla", DEV, host_pool_gib=0.002, hot_buffer_tokens=2, resident_window=4,
                    page_tokens=16, kernels="triton")
    lockstep = GatherLockstep(resident, kv)
    greedy_generate(model, lockstep, prompt, 3, chunk=30)
    assert lockstep.compared["gather"] == 4 * len(model.layers) and kv.stats.misses > 0


@needs_kernels
def test_resident_triton_equals_torch(model, seed: int) -> None:
    prompt = torch.randint(0, model.cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(seed)).tolist()
    lockstep = LockstepKV(*(ResidentKV(model.cfg, "fp8_ds_mla", DEV, kernels=k) for k in ("torch", "triton")))
    greedy_generate(model, lockstep, prompt, 4, chunk=25)
    assert lockstep.compared["attend"] == 5 * len(model.layers)


def test_kernels_setting() -> None:
    """One home for the option: auto is Triton on CUDA only; a bad value and an impossible 'triton' name the
    field; the built stores take the resolved path."""
    cfg = random_model(preset_params("tiny"), seed=0).cfg
    assert KVSettings().kernel_path("cpu") == "torch"
    assert KVSettings().kernel_path("cuda") == ("triton" if triton_support.available() else "torch")
    assert KVSettings(kernels="torch").kernel_path("cuda") == "torch"
    with pytest.raises(KVSettingsError, match="kernels"):
        KVSettings(kernels="cuda")
    assert KVSettings(offload="none").build(cfg).kernels == "torch"
    if runnable:
        assert KVSettings(kernels="triton").build(cfg, DEV).kernels == "triton"
    else:
        with pytest.raises(KVSettingsError, match="kernels"):
            KVSettings(kernels="triton").build(cfg, "cpu")


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_support.available()),
                    reason="needs CUDA and triton: host syncs exist only between a CUDA device and its host")
def test_triton_decode_seam_makes_no_host_sync(model) -> None:
    """Every KV write and attention of a decode step of 3 requests on the Triton path (miss-path launch, sparse
    MLA, backups) under torch.cuda.set_sync_debug_mode('error'): no call waits for the device."""
    from hisparse.engine.generate import prefill
    from hisparse.core.batch import Segment
    cfg = model.cfg
    kv = HiSparseKV(cfg, "fp8_ds_mla", "cuda", host_pool_gib=0.002, hot_buffer_tokens=10, resident_window=6,
                    page_tokens=16, kernels="triton")
    g = torch.Generator().manual_seed(0)
    lengths = (70, 41, 90)
    for req, n in enumerate(lengths):
        prefill(model, kv, req, torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), chunk=32)
    kv.begin_step([Segment(req, n, 1) for req, n in enumerate(lengths)])
    seg = torch.arange(3, device="cuda")
    pos = torch.tensor(lengths, device="cuda")
    sel = torch.stack([torch.randperm(n, generator=g)[:cfg.index_topk] for n in lengths]).cuda()
    rows = torch.randn(3, cfg.latent_dim, device="cuda")
    q_lat = torch.randn(3, cfg.n_heads, cfg.kv_lora_rank, device="cuda")
    q_rope = torch.randn(3, cfg.n_heads, cfg.qk_rope_head_dim, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for spec in cfg.layers:
            if spec.kv_owner:
                kv.write(spec.index, seg, pos, rows)
            kv.attend(spec.index, q_lat, q_rope, seg, sel, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    kv.end_step()
    assert kv.stats.misses > 0
