"""Full-step decode graphs (hisparse/engine/full_graph.py).

On the CPU every step runs the static step function eagerly, which is what a CUDA graph records and replays. The
tests record the device ops of that function (every layer, every LatentKV call, the store's end-of-step work, the
head) for steps of 1, 4 and 16 requests with different contexts, hit/miss mixes and a request joining between
steps: the op sequence and shapes are the same for every step of one step shape, no op reads a device value on
the host or has a data-dependent size, and greedy tokens equal the eager engine's, with HiSparse on and off.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hisparse.core import triton_support
from hisparse.core.batch import PAD, Segment
from hisparse.core.config import preset_params
from hisparse.engine.engine import Engine
from hisparse.engine.full_graph import FullGraphs, StepGraph
from hisparse.engine.generate import prefill
from hisparse.engine.request import SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.kv.resident import ResidentKV
from hisparse.kv.settings import KVSettings
from hisparse.model.tiny import random_model

from test_host_sync import INTERPRETER, device_path, host_reads, reads_device  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("single_thread")
triton_interpreted = pytest.mark.skipif(not (triton_support.available() and triton_support.interpreted()),
                                        reason="needs triton (the MoE's grouped experts; interpreted on the CPU)")


class StepOps(TorchDispatchMode):
    """Every aten op (name, tensor shapes and dtypes) of one step, and every host read of a device value, outside
    Triton's interpreter (a kernel's body is device code)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not inside_interpreter():
            flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            self.ops.append((func._schema.name, tuple((tuple(t.shape), t.dtype) for t in flat
                                                      if isinstance(t, torch.Tensor))))
            if reads_device(func, args):
                self.reads.append(func._schema.name)
        return func(*args, **(kwargs or {}))

    def host_read(self, method: str) -> None:
        if not inside_interpreter():
            self.reads.append(method)


def inside_interpreter() -> bool:
    import traceback
    return any(f.filename.endswith(INTERPRETER) for f in traceback.extract_stack())


@pytest.fixture(scope="module")
def model():
    p = preset_params("tiny")
    p["index_topk"] = 16      # below the contexts: hits and misses through a 16-slot hot buffer
    m = random_model(p, seed=3)
    m.use_kernels("triton")   # the grouped experts: static shapes (the torch MoE reads routing counts)
    yield m
    m.use_kernels("auto")


def budget(cfg, slots: int, resident_window: int, pages: int = 32) -> float:
    """device_kv_gib: `slots` working sets of the tests' geometry and `pages` resident pages beside them."""
    return HiSparseKV(cfg, "fp8_ds_mla", host_pool_gib=0.004, hot_buffer_tokens=16, resident_window=resident_window,
                      page_tokens=16).budget_gib(slots, pages)


def stores(cfg):
    gib = budget(cfg, 17, 4)
    return {"resident": lambda: ResidentKV(cfg, "fp8_ds_mla", page_tokens=16),
            "hisparse": lambda: HiSparseKV(cfg, "fp8_ds_mla", host_pool_gib=0.004, hot_buffer_tokens=16,
                                           resident_window=4, page_tokens=16),
            "hybrid": lambda: HiSparseKV(cfg, "fp8_ds_mla", host_pool_gib=0.004, hot_buffer_tokens=16,
                                         resident_window=4, page_tokens=16, device_kv_gib=gib),
            "hybrid-triton": lambda: HiSparseKV(cfg, "fp8_ds_mla", host_pool_gib=0.004, hot_buffer_tokens=16,
                                                resident_window=4, page_tokens=16, device_kv_gib=gib,
                                                kernels="triton")}


@triton_interpreted
@pytest.mark.parametrize("store", ["resident", "hisparse", "hybrid",
                                   pytest.param("hybrid-triton", marks=pytest.mark.slow)])
def test_a_step_shape_replays_the_same_ops_without_host_reads(model, store, device_path, monkeypatch) -> None:  # noqa: F811
    """Steps of 1, 3 -> 4 (a request joins between steps) and 9 -> 16 requests: within each step shape the
    recorded ops and shapes are identical, and none reads the device from the host. `hybrid-triton` records the
    step a GPU replays: the KV calls through the Triton kernels (interpreted; their bodies are device code)."""
    cfg = model.cfg
    kv = stores(cfg)[store]()
    kv.reserve_device(17, 64, 32)      # as a server that knows its limits: no store grows between steps
    graphs = FullGraphs(model, kv, 16)
    traces: dict[tuple, list] = defaultdict(list)
    body = StepGraph.body

    def recorded(self, views):
        rec = StepOps()
        with rec, host_reads(rec.host_read):
            out = body(self, views)
        traces[self.key].append(rec)
        return out
    monkeypatch.setattr(StepGraph, "body", recorded)
    g = torch.Generator().manual_seed(7)
    lengths = iter(torch.randint(34, 56, (16,), generator=g).tolist())   # every context within a 64-span
    ctx: dict[int, int] = {}

    def join(n: int) -> None:
        for _ in range(n):
            r, L = len(ctx), next(lengths)
            prefill(model, kv, r, torch.randint(0, cfg.vocab_size, (L,), generator=g).tolist(), chunk=32)
            ctx[r] = L

    def decode(reqs: list[int], steps: int) -> None:
        for _ in range(steps):
            tokens = torch.randint(0, cfg.vocab_size, (len(reqs),), generator=g)
            graphs.forward(tokens, [Segment(r, ctx[r], 1) for r in reqs], kv)
            for r in reqs:
                ctx[r] += 1
    join(1)
    decode([0], 3)                          # bucket 1
    join(2)
    decode([0, 1, 2], 2)                    # bucket 4, one padding segment
    join(1)
    decode([0, 1, 2, 3], 2)                 # a request joined: bucket 4, no padding
    join(5)
    decode(list(range(9)), 2)               # bucket 16, seven padding segments
    join(7)
    decode(list(range(16)), 2)
    assert {k[:2] for k in traces} == {(1, 1), (4, 1), (16, 1)}
    for key, recs in traces.items():
        assert len(recs) >= 2
        for rec in recs:
            assert not rec.reads, f"{key}: host reads of device values {rec.reads}"
            assert rec.ops == recs[0].ops, f"{key}: the ops of a step depend on the step"
        names = {op for op, _ in recs[0].ops}
        assert {"aten::index_copy_", "aten::sort"} <= names     # the KV calls are inside the recorded step
    if store != "resident":
        kv.sync_stats()
        assert kv.stats.hits and kv.stats.misses, "the steps were meant to mix hits and misses"
    if store.startswith("hybrid"):
        assert kv.stats.spilled_pages and kv.stats.resident_hits, "the device budget was meant to spill"


def engine_tokens(model, kv, prompts, full: bool, max_tokens: int = 10) -> list[list[int]]:
    graphs = FullGraphs(model, kv, 8) if full else None
    engine = Engine(model, kv, SchedulerConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64),
                    graphs=graphs)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    if full:
        assert graphs.steps >= max_tokens - 1
    return [r.output for r in reqs]


@pytest.mark.parametrize("offload", ["none", "hisparse", "hybrid"])
def test_greedy_tokens_equal_the_eager_engine(seed: int, offload: str) -> None:
    """Six requests of different lengths decoding together (padding in the bucket of 8, requests finishing):
    the full-step engine's greedy tokens equal the eager engine's, and with HiSparse on they equal ResidentKV's.
    The hybrid store's budget spills pages."""
    model = random_model(preset_params("tiny"), seed=seed % 10_000)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (37, 5, 70, 21, 90, 13)]
    make = lambda off: KVSettings(offload=off, host_pool_gib=0.01, hot_buffer_tokens=16, resident_window=8,  # noqa: E731
                                  page_tokens=16, device_kv_gib=budget(model.cfg, 7, 8, 8)).build(model.cfg,
                                                                                               dtype=torch.float32)
    reference = engine_tokens(model, make("none"), prompts, full=False)
    kv = make(offload)
    assert engine_tokens(model, kv, prompts, full=True) == reference
    if offload == "hybrid":
        assert kv.stats.spilled_pages > 0
    assert engine_tokens(model, make(offload), prompts, full=False) == reference


@pytest.mark.parametrize("hybrid", [False, True], ids=["hisparse", "hybrid"])
def test_padding_holds_a_reserved_page_and_is_not_counted(seed: int, hybrid: bool) -> None:
    """The padding request holds one reserved page; three requests padded to the bucket of 4 give the eager
    steps' logits and count exactly their lookups and bytes."""
    model = random_model(preset_params("tiny"), seed=seed % 10_000)
    # hybrid: the same 4 resident pages beside the eager store's 3 working sets and the static one's 4 (padding's)
    make = lambda slots: HiSparseKV(model.cfg, "fp8_ds_mla", host_pool_gib=0.004,  # noqa: E731
                                    hot_buffer_tokens=16, resident_window=4, page_tokens=16,
                                    device_kv_gib=budget(model.cfg, slots, 4, 4) if hybrid else None)
    eager, static = make(3), make(4)
    graphs = FullGraphs(model, static, 4)
    assert static.reserved[PAD] == 16
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (40, 23, 61)]
    for kv in (eager, static):
        for r, p in enumerate(prompts):
            prefill(model, kv, r, p, chunk=32)
        kv.sync_stats()
    for step in range(3):
        segs = [Segment(r, len(p) + step, 1) for r, p in enumerate(prompts)]
        tokens = torch.randint(0, model.cfg.vocab_size, (3,), generator=g)
        want = model(tokens, segs, eager, logits_at=torch.arange(3))
        got = graphs.forward(tokens, segs, static)    # dense ops over 4 rows instead of 3: fp32 rounding apart
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    for kv in (eager, static):
        kv.sync_stats()
    assert static.stats.snapshot() == eager.stats.snapshot()
    assert static.stats.misses > 0


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_support.available()),
                    reason="needs CUDA and triton: graph capture exists only on a CUDA device")
@pytest.mark.parametrize("offload", ["hisparse", "hybrid"])
def test_recorded_steps_replay_the_eager_tokens(seed: int, offload: str) -> None:
    """On CUDA with the Triton kernels: the full-step engine records its steps and replays them, and its greedy
    tokens equal the eager engine's."""
    model = random_model(preset_params("tiny"), seed=seed % 10_000).cuda()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (37, 5, 70, 21, 90, 13)]
    make = lambda: KVSettings(offload=offload, host_pool_gib=0.01, hot_buffer_tokens=16, resident_window=8,  # noqa: E731
                              page_tokens=16, device_kv_gib=budget(model.cfg, 7, 8, 8), kernels="triton").attach(model)
    cfg = SchedulerConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    eager = [r.output for r in Engine(model, make(), cfg).generate(prompts, params)]
    kv = make()
    graphs = FullGraphs(model, kv, 8, capture=True)
    full = [r.output for r in Engine(model, kv, cfg, graphs=graphs).generate(prompts, params)]
    assert full == eager
    assert any(g.graph is not None for g in graphs.graphs.values()), "no step was recorded"
