"""Full-step CUDA graphs for decode (`--cuda-graph full`): the whole decode step (embedding, every layer with every
LatentKV call, the store's end-of-step device work, the head) as one graph per step shape.

A step of S segments of q rows each (a decode token, or a verify segment's anchor and drafts) runs at the
smallest bucket B >= S: B - S padding segments of the `PAD` request (a page and a slot of its own, rows nobody
else reads, left out of the statistics) fill it, so every tensor of the step has a shape fixed by the key
(B, q, span). `span` is the positions every page table covers: the longest context rounded up to a power of two
(at least a page), so key scans grow with the context in a few steps and a graph is captured per key at its first
step. What changes between steps (tokens, positions and the store's tables: pages, lengths, slots, the LRU stamp)
goes to the device in one host->device copy into buffers fixed per key (`StepInputs`); the host work of a step is
the store's `begin_step` and `end_step_host`, O(requests), and one replay. The store counts on the device and reads
its counters every `hisparse_kv.STATS_EVERY` steps.

The first step of a key runs the step eagerly (its result, and the warm-up) and then records it; later steps of
the key replay. A capture that fails names the op that broke it and leaves decode eager on the same static code.
A store that reallocates a buffer a graph holds (a grown arena or key store) drops the graphs; they are recorded
again at their next step. Without capture (the CPU) every step runs the same static code eagerly: the tests
record its ops.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.batch import PAD, ForwardTrace, Segment, segment_positions
from ..core.step_inputs import StepInputs
from ..kv.base import LatentKV
from ..model.attention import AttentionBatch
from ..model.ml4 import ML4
from .cuda_graphs import RowBuffers, bucket_sizes

log = logging.getLogger(__name__)


class LastOp(TorchDispatchMode):
    """Remembers the last aten op called (what a failed capture was doing)."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "(none)"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.name = func._schema.name
        return func(*args, **(kwargs or {}))


class StepGraph:
    """One step shape (B segments of q rows over page tables of `span` positions): its static function and, once
    recorded, its CUDA graph."""

    def __init__(self, model: ML4, kv: LatentKV, key: tuple[int, int, int], taps: tuple[int, ...],
                 out: RowBuffers):
        self.model, self.kv, self.key, self.taps, self.out = model, kv, key, taps, out
        segments, rows_per_seg, _ = key
        self.seg = torch.arange(segments, device=model.device).repeat_interleave(rows_per_seg)   # [B q], fixed
        self.graph: torch.cuda.CUDAGraph | None = None

    @torch.no_grad()
    def body(self, views: dict[str, torch.Tensor]) -> None:
        """The whole step on the key's static inputs; logits [B q, V] and tapped hidden states to `out`."""
        model, positions = self.model, views["positions"]
        cos, sin = model.rope(positions)
        b = AttentionBatch(positions, self.seg, self.kv, cos, sin, {})
        h = model.tok_embeddings(views["tokens"])
        for layer in model.layers:
            h = layer(h, b)
            if layer.spec.index in self.taps:
                self.out.put(f"tap{layer.spec.index}", h)
        self.kv.end_step_device()
        self.out.put("logits", model.head(h))

    def record(self, views: dict[str, torch.Tensor], pool: object) -> None:
        """Record the body as a CUDA graph (nothing runs: the step's own result came from its eager run)."""
        graph, seen = torch.cuda.CUDAGraph(), LastOp()
        try:
            # thread_local: the server's other threads may use CUDA while a step shape is recorded mid-serving
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"), seen:
                self.body(views)
        except Exception as e:
            raise RuntimeError(f"full-step CUDA graph capture failed at {seen.name}: {type(e).__name__}: {e}") from e
        self.graph = graph


class FullGraphs:
    """Full-step graphs of a model's decode steps of up to `max_segments` segments (recorded per step shape at
    its first step when `capture`; eager static steps otherwise)."""

    def __init__(self, model: ML4, kv: LatentKV, max_segments: int, max_rows_per_seg: int = 1,
                 capture: bool = False):
        if kv.device.type == "cuda" and kv.kernels != "triton":
            raise ValueError("--cuda-graph full: needs --kernels triton on CUDA (the torch path copies misses "
                             "from the host)")
        if not kv.reserve(PAD, max_rows_per_seg) or kv.max_working_sets() == 1:
            raise ValueError("--cuda-graph full: the KV cache has no room for the padding segments' page and working "
                             "set beside a request's")
        self.model, self.kv, self.capture = model, kv, capture
        self.buckets = bucket_sizes(max_segments)
        self.max_rows_per_seg = max_rows_per_seg
        self.inputs = StepInputs(model.device, static=True)
        # logits (made up front) and taps of every step shape, outside any graph
        self.out = RowBuffers(self.buckets[-1] * max_rows_per_seg)
        self.out.buffers["logits"] = torch.empty(self.out.rows, model.cfg.vocab_size, dtype=model.logits_dtype,
                                                 device=model.device)
        self.graphs: dict[tuple[int, int, int], StepGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.held: tuple[int, ...] = ()     # the addresses of the store's buffers the graphs were recorded on
        self.steps = 0

    def handles(self, segments: Sequence[Segment], logit_rows: Sequence[int]) -> bool:
        """A decode or verify step: every segment has the same length (at most max_rows_per_seg), every row
        returns its logits, at most the largest bucket of segments."""
        if not segments or len(segments) > self.buckets[-1]:
            return False
        q = segments[0].length
        return q <= self.max_rows_per_seg and all(s.length == q == k for s, k in zip(segments, logit_rows,
                                                                                      strict=True))

    def span(self, segments: Sequence[Segment]) -> int:
        """The positions every page table of the step covers: its longest context, rounded up to a power of two
        of at least one page, in whole pages."""
        P = self.kv.page_tokens
        longest = max(s.start + s.length for s in segments)
        return -(-max(P, 1 << (longest - 1).bit_length()) // P) * P

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], kv: LatentKV,
                trace: ForwardTrace | None = None) -> torch.Tensor:
        """tokens [n] (host) of the segments' n rows -> logits [n, V], as `ML4.forward` gives them."""
        S, q = len(segments), segments[0].length
        B = min(b for b in self.buckets if b >= S)
        padded = list(segments) + [Segment(PAD, 0, q)] * (B - S)
        positions, _ = segment_positions(padded)
        self.inputs.stage("tokens", torch.cat((tokens.cpu(), tokens.new_zeros((B - S) * q, device="cpu"))))
        self.inputs.stage("positions", positions)
        span = self.span(segments)
        views = kv.begin_step(padded, inputs=self.inputs, span=span)
        key = (B, q, span)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = StepGraph(self.model, kv, key, trace.tap_layers if trace else (), self.out)
        held = self.addresses()
        if graph.graph is not None and self.held == held:
            graph.graph.replay()
        else:
            self.run_eager(graph, views, held)
        kv.end_step_host()
        self.steps += 1
        if trace is not None:
            trace.taps.update({i: self.out.get(f"tap{i}", S * q).clone() for i in graph.taps})
        return self.out.get("logits", S * q).clone()

    def run_eager(self, graph: StepGraph, views: dict[str, torch.Tensor], held: tuple[int, ...]) -> None:
        """Run a key's step eagerly, then (capturing) record it; graphs recorded on buffers the store has since
        reallocated (`held`: the addresses now) are dropped first."""
        if not self.capture:
            graph.body(views)
            return
        if self.held != held:
            for g in self.graphs.values():
                g.graph = None
            self.held = held
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                  # the step itself, and the warm-up of its recording
            graph.body(views)
        torch.cuda.current_stream().wait_stream(side)
        t0 = time.perf_counter()
        self.kv.forget_step()
        try:
            graph.record(views, self.pool)
        except RuntimeError as e:
            log.warning("%s; decode steps run eagerly (--cuda-graph piecewise or off skip the attempt)", e)
            self.capture = False
        else:
            log.info("recorded the full decode step of %d segments x %d rows over %d positions in %.2f s",
                     *graph.key, time.perf_counter() - t0)

    def addresses(self) -> tuple[int, ...]:
        """Where the store's buffers are now (a graph replays on the addresses it was recorded on)."""
        return tuple(t.data_ptr() for t in self.kv.device_buffers())
