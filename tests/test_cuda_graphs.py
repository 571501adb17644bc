"""Piecewise decode graphs (hisparse/engine/cuda_graphs.py).

On the CPU the pieces run eagerly over the static rows every bucket uses, which checks everything but the capture
itself: the piecewise step gives the plain forward's logits, padding rows never reach a real row, and every
piece runs the same ops on the same shapes for any step of a bucket, with no host synchronisation (what a
CUDA graph needs to replay it). With CUDA, capture + replay is checked against eager.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hisparse.parallel.context import DCPContext
from hisparse.parallel.sharded_kv import ShardedKV
from hisparse.parallel.launch import launch
from hisparse.engine.cuda_graphs import DecodeGraphs, GraphSettingError, bucket_sizes, capture_graphs, graphs_wanted
from hisparse.engine.engine import Engine
from hisparse.engine.generate import prefill
from hisparse.engine.request import SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.core import triton_support
from hisparse.core.batch import Segment
from hisparse.core.config import preset_params
from hisparse.kv.resident import ResidentKV
from hisparse.model.tiny import random_model
from hisparse.model.weights import load_model, save_model
from hisparse.parallel.tp import shard_for
from hisparse.server.metrics import Metrics

from conftest import tiny_model
from test_dcp import hisparse_kv
from test_host_sync import SYNC_OPS

pytestmark = pytest.mark.usefixtures("single_thread")
LENGTHS = (37, 21, 50, 9)


@pytest.fixture(scope="module")
def model(seed: int):
    return random_model(preset_params("tiny"), seed=seed % 10_000)


def prompts(cfg, seed: int, lengths=LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


def decode_both(model, make_kv, graphs: DecodeGraphs, n_req: int, steps: int, seed: int):
    """Two stores with the same prompts; each step feeds the same tokens to the plain forward (first store) and
    the piecewise one (second): yields both logits [n_req, V]."""
    kvs = [make_kv(), make_kv()]
    ps = prompts(model.cfg, seed)[:n_req]
    for kv in kvs:
        for req, p in enumerate(ps):
            prefill(model, kv, req, p, chunk=16)
    pos = [len(p) for p in ps]
    tokens = torch.randint(0, model.cfg.vocab_size, (n_req,), generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        segs = [Segment(r, pos[r], 1) for r in range(n_req)]
        plain = model(tokens, segs, kvs[0], logits_at=torch.arange(n_req))
        piecewise = graphs.forward(tokens, segs, kvs[1])
        yield plain, piecewise
        tokens = plain.argmax(-1)
        pos = [p + 1 for p in pos]


def test_full_bucket_is_bit_identical_to_the_forward(model, seed: int) -> None:
    """4 requests in the bucket of 4 (no padding), HiSparse fp8: the same ops on the same shapes as the plain
    forward, so every decode step's logits are bit-identical."""
    graphs = DecodeGraphs(model, 4, capture=False)
    make = lambda: HiSparseKV(model.cfg, "fp8_ds_mla", host_pool_gib=0.002, hot_buffer_tokens=8,  # noqa: E731
                              resident_window=4, page_tokens=16)
    for plain, piecewise in decode_both(model, make, graphs, 4, 3, seed):
        assert torch.equal(plain, piecewise)


def test_padded_bucket_gives_the_forward_logits(model, seed: int) -> None:
    """3 requests padded to the bucket of 4, exact stored rows: the logits agree within fp32 rounding (the dense
    ops run on 4 rows instead of 3)."""
    graphs = DecodeGraphs(model, 4, capture=False)
    make = lambda: ResidentKV(model.cfg, None)  # noqa: E731
    for plain, piecewise in decode_both(model, make, graphs, 3, 3, seed):
        torch.testing.assert_close(piecewise, plain, rtol=1e-5, atol=1e-5)
        assert torch.equal(piecewise.argmax(-1), plain.argmax(-1))


def test_padding_rows_never_reach_a_real_row(model, seed: int) -> None:
    """The same 2-request step in the bucket of 4, once with zero padding rows and once with random tokens and
    positions left in them: bit-identical logits."""
    graphs = DecodeGraphs(model, 4, capture=False)
    rows = graphs.rows
    out = []
    for fill in (False, True):
        kv = ResidentKV(model.cfg, None)
        for req, p in enumerate(prompts(model.cfg, seed)[:2]):
            prefill(model, kv, req, p, chunk=16)
        if fill:
            rows.tokens.random_(0, model.cfg.vocab_size)
            rows.positions.random_(0, 60)
        else:
            rows.tokens.zero_()
            rows.positions.zero_()
        out.append(graphs.forward(torch.tensor([3, 4]), [Segment(0, LENGTHS[0], 1), Segment(1, LENGTHS[1], 1)], kv))
    assert torch.equal(*out)


class OpShapes(TorchDispatchMode):
    """Records every aten op with its tensor arguments' shapes and dtypes, outside Triton's interpreter."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        self.ops.append((func._schema.name, tuple((tuple(t.shape), t.dtype) for t in flat
                                                  if isinstance(t, torch.Tensor))))
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not (triton_support.available() and triton_support.interpreted()),
                    reason="needs triton (the MoE's grouped experts; interpreted on the CPU)")
def test_every_piece_has_static_shapes_and_no_host_sync(seed: int) -> None:
    """What capture needs: two decode steps of one bucket (different requests, positions, tokens and expert
    routing) run the same aten ops on the same shapes in every piece, and no op that reads the device."""
    model = random_model(preset_params("tiny"), seed=seed % 10_000)
    model.use_kernels("triton")
    try:
        graphs = DecodeGraphs(model, 8, capture=False)
        bucket = graphs.buckets[8]
        kv = ResidentKV(model.cfg, "fp8_ds_mla")
        for req, p in enumerate(prompts(model.cfg, seed, (30, 12, 44, 7, 25))):
            prefill(model, kv, req, p, chunk=16)
        traces = []
        for segs in ([Segment(0, 30, 1), Segment(1, 12, 1), Segment(2, 44, 1)],
                     [Segment(3, 7, 1), Segment(4, 25, 1)]):
            recorded = []
            for piece in bucket.pieces:   # each piece's function, as a capture would record it
                with OpShapes() as rec:
                    piece.run()
                recorded.append(rec.ops)
            traces.append(recorded)
            graphs.forward(torch.randint(0, 512, (len(segs),)), segs, kv)   # moves the buffers on
        for i, (a, b) in enumerate(zip(*traces, strict=True)):
            assert a == b, f"piece {i}: ops or shapes depend on the step"
            syncs = {name for name, _ in a if name.split("::")[-1] in SYNC_OPS}
            assert not syncs, f"piece {i} reads the device: {syncs}"
        assert len(traces[0]) == len(model.layers) + 1
    finally:
        model.use_kernels("torch")


def test_engine_decodes_through_the_graphs(model, seed: int) -> None:
    """An engine whose runner has decode graphs produces the tokens of one without (greedy, 3 requests)."""
    ps = prompts(model.cfg, seed)[:3]
    outs = []
    for graphs in (None, DecodeGraphs(model, 4, capture=False)):
        kv = HiSparseKV(model.cfg, "fp8_ds_mla", host_pool_gib=0.002, hot_buffer_tokens=8, resident_window=4,
                        page_tokens=16)
        engine = Engine(model, kv, SchedulerConfig(max_model_len=128, max_num_seqs=4), graphs=graphs)
        metrics = Metrics()
        engine.on_step = metrics.observe
        outs.append([r.output for r in engine.generate(ps, SamplingParams(max_tokens=6, temperature=0.0))])
    assert outs[0] == outs[1]
    assert graphs.steps >= 5          # the decode steps after the prompts' last chunks
    assert f"hisparse_cuda_graph_steps_total {float(graphs.steps)}" in metrics.render().decode()


def parallel_rank(group, ckpt: str, seed: int) -> dict:
    """On this rank of TP2 (TP2 + DCP2: the seams' collectives too): plain vs piecewise decode steps of 2
    requests, each on its own HiSparse store; the pieces' all-reduces run in the same order on both ranks."""
    out = {}
    for dcp in (1, 2):
        model = load_model(Path(ckpt), dtype=torch.float32, shard=shard_for(group), progress=False)
        ctx = DCPContext(group, 1, heads_split=True)
        make = (lambda: ShardedKV(hisparse_kv(model), ctx)) if dcp > 1 else (lambda: hisparse_kv(model))
        graphs = DecodeGraphs(model, 2, capture=False)
        out[dcp] = [(plain, piecewise) for plain, piecewise in decode_both(model, make, graphs, 2, 3, seed)]
    return out


def test_tensor_parallel_piecewise_equals_the_forward(tmp_path, seed: int) -> None:
    """TP2 and TP2 + DCP2 on 2 processes: every rank's piecewise decode logits are bit-identical to its plain
    forward's, and both ranks hold the same logits."""
    save_model(tiny_model(seed, torch.float32, sharp=False), tmp_path / "ckpt")
    ranks = launch(parallel_rank, 2, str(tmp_path / "ckpt"), seed, threads=1, timeout_s=60.0, deadline_s=600.0)
    for dcp in (1, 2):
        for r in ranks:
            assert len(r[dcp]) == 3
            for plain, piecewise in r[dcp]:
                assert torch.equal(plain, piecewise), f"DCP {dcp}"
        assert all(torch.equal(a[0], b[0]) for a, b in zip(ranks[0][dcp], ranks[1][dcp]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a capture that fails: here, one without CUDA")
def test_a_failed_capture_falls_back_to_eager_only_where_allowed(model, caplog) -> None:
    """One rank: a capture that fails (here torch's own error: no CUDA) logs why and gives eager decode; on
    parallel ranks the error stands."""
    with caplog.at_level("WARNING", logger="hisparse.engine.cuda_graphs"):
        assert capture_graphs(model, 2, fallback=True) is None
    assert "capture failed" in caplog.text and "decode steps run eagerly" in caplog.text
    with pytest.raises(Exception):
        capture_graphs(model, 2, fallback=False)


def test_graph_settings() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graphs_wanted("full", "cpu", "torch") is None
    assert graphs_wanted("full", "cuda", "triton") == "full"
    assert graphs_wanted("piecewise", "cuda", "triton") == "piecewise"
    assert graphs_wanted("full", "cuda", "torch") is None
    assert graphs_wanted("off", "cuda", "triton") is None
    with pytest.raises(GraphSettingError, match="--cuda-graph piecewise: needs a CUDA device"):
        graphs_wanted("piecewise", "cpu", "triton")
    with pytest.raises(GraphSettingError, match="--kernels triton"):
        graphs_wanted("piecewise", "cuda", "torch")
    with pytest.raises(GraphSettingError, match="must be one of"):
        graphs_wanted("yes", "cuda", "triton")


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_support.available()),
                    reason="needs CUDA and triton: graph capture exists only on a CUDA device")
def test_captured_graphs_replay_the_eager_pieces(seed: int) -> None:
    """Captured piecewise graphs (HiSparse, Triton kernels) give the eager pieces' logits, step after step."""
    model = random_model(preset_params("tiny"), seed=seed % 10_000).cuda()
    model.use_kernels("triton")
    make = lambda: HiSparseKV(model.cfg, "fp8_ds_mla", "cuda", host_pool_gib=0.002,  # noqa: E731
                              hot_buffer_tokens=8, resident_window=4, page_tokens=16, kernels="triton")
    captured, eager = DecodeGraphs(model, 4, capture=True), DecodeGraphs(model, 4, capture=False)
    assert all(p.graph is not None for b in captured.buckets.values() for p in b.pieces)
    kvs = [make(), make()]
    for kv in kvs:
        for req, p in enumerate(prompts(model.cfg, seed)[:3]):
            prefill(model, kv, req, p, chunk=16)
    tokens, pos = torch.tensor([1, 2, 3], device="cuda"), list(LENGTHS[:3])
    for _ in range(4):
        segs = [Segment(r, pos[r], 1) for r in range(3)]
        a, b = captured.forward(tokens, segs, kvs[0]), eager.forward(tokens, segs, kvs[1])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        tokens, pos = b.argmax(-1), [p + 1 for p in pos]
