"""Piecewise CUDA graphs for decode steps (`--cuda-graph`).

A decode step of n rows (one per request, or a speculative verify segment's anchor and drafts per request) runs at
the smallest bucket size B >= n: its tokens and positions are copied into the bucket's static buffers (rows
n..B-1 are padding: token 0 at position 0) and the forward runs as L + 1 pieces around the L KV seams, the way
vLLM's PIECEWISE mode runs attention between captured graphs:
- piece 0: embedding, rope tables and layer 0's projections (`Block.project`);
- piece i: layer i-1's output (`Block.finish`) and layer i's projections;
- piece L: the last layer's output and the head.
Each piece has the bucket's static shapes and no host synchronisation, so on CUDA it is captured once per bucket
and replayed. The seams (`Block.seam`: every LatentKV write, select and attend) run eagerly on the n real rows
between the pieces: the working set's miss path, its copy stream and its data-dependent work stay outside the
graphs. Every piece computes each row on its own (row-wise projections, per-row routing and grouped experts), so
the padding rows never reach a real row.

Without capture (`capture=False`, the CPU) the pieces run eagerly on the same static buffers: tests check the
piecewise step against the plain forward, and that every piece's ops and shapes depend on the bucket only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import fields

import torch

from ..model.attention import AttentionBatch, Queries
from ..model.batch import ForwardTrace, Segment, segment_positions
from ..model.kv import LatentKV
from ..model.ml4 import ML4

log = logging.getLogger(__name__)

GRAPH_MODES = ("auto", "on", "off")


class GraphSettingError(ValueError):
    """`--cuda-graph` cannot be honoured as given."""


def graphs_wanted(mode: str, device: torch.device | str, kernels: str) -> bool:
    """Whether decode runs piecewise CUDA graphs: 'auto' on CUDA with the Triton kernels; 'on' the same or an
    error saying what is missing; 'off' never."""
    if mode not in GRAPH_MODES:
        raise GraphSettingError(f"--cuda-graph: must be one of {list(GRAPH_MODES)}, got {mode!r}")
    missing = [why for bad, why in ((torch.device(device).type != "cuda", "a CUDA device"),
                                    (kernels != "triton", "--kernels triton (the torch MoE reads routing counts on "
                                                          "the host)")) if bad]
    if mode == "on" and missing:
        raise GraphSettingError(f"--cuda-graph on: needs {' and '.join(missing)}")
    return mode != "off" and not missing


def capture_graphs(model: ML4, max_rows: int, fallback: bool) -> DecodeGraphs | None:
    """Capture the decode graphs; with `fallback` ('auto' on one rank) a capture that fails logs why and decode
    runs eagerly (None). Parallel ranks never fall back alone: the others would wait in a captured collective."""
    try:
        return DecodeGraphs(model, max_rows, capture=True)
    except Exception as e:   # noqa: BLE001 - any capture failure: eager decode is always correct
        if not fallback:
            raise
        log.warning("piecewise CUDA graph capture failed (%s: %s); decode steps run eagerly (--cuda-graph off "
                    "skips the attempt)", type(e).__name__, e)
        return None


def bucket_sizes(max_rows: int) -> list[int]:
    """Row counts graphs are made for: 1, 2, 4, 8, then every multiple of 8 up to max_rows (and max_rows)."""
    sizes = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, max_rows, 8)) + [max_rows]
    return sorted(set(sizes))


def _narrow(q: Queries, n: int) -> Queries:
    return Queries(*(None if t is None else t[:n] for t in (getattr(q, f.name) for f in fields(Queries))))


class Piece:
    """One dense region of the forward over static buffers: captured as a CUDA graph, or run eagerly."""

    def __init__(self, fn: Callable[[], tuple], capture: bool, pool: object | None = None):
        self.fn, self.graph = fn, None
        self.out = fn()                                     # first run: lazy weights (stacked experts) get built
        if capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                   # warm-up off the capturing stream, as torch advises
                fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.out = fn()
            self.graph.replay()                             # the outputs hold values for the next piece's warm-up

    def run(self) -> tuple:
        if self.graph is None:
            self.out = self.fn()
        else:
            self.graph.replay()
        return self.out


class BucketGraphs:
    """The pieces of one bucket size: static inputs (tokens, positions, the seam's olat) and L + 1 pieces."""

    @torch.no_grad()
    def __init__(self, model: ML4, size: int, capture: bool, pool: object | None):
        cfg, dev = model.cfg, model.device
        self.size = size
        self.tokens = torch.zeros(size, dtype=torch.long, device=dev)
        self.positions = torch.zeros(size, dtype=torch.long, device=dev)
        heads = model.layers[0].attention.n_heads
        self.olat = torch.zeros(size, heads, cfg.kv_lora_rank, dtype=model.dtype, device=dev)
        # the pieces' batch: positions and rope tables only (the seams get their own batch of the real rows)
        self.batch = AttentionBatch(self.positions, torch.zeros_like(self.positions), None, None, None, {})
        layers = model.layers

        def first() -> tuple:
            self.batch.cos, self.batch.sin = model.rope(self.positions)
            h = model.tok_embeddings(self.tokens)
            return h, layers[0].project(h, self.batch), self.batch.cos, self.batch.sin

        def middle(i: int) -> Callable[[], tuple]:
            def piece() -> tuple:
                h = layers[i - 1].finish(self.pieces[i - 1].out[0], self.olat)
                return h, layers[i].project(h, self.batch)
            return piece

        def last() -> tuple:
            h = layers[-1].finish(self.pieces[len(layers) - 1].out[0], self.olat)
            return h, model.head(h)

        self.pieces: list[Piece] = []
        for fn in [first] + [middle(i) for i in range(1, len(layers))] + [last]:
            self.pieces.append(Piece(fn, capture, pool))
        self.batch.cos, self.batch.sin = self.pieces[0].out[2:]

    @torch.no_grad()
    def forward(self, model: ML4, tokens: torch.Tensor, segments: Sequence[Segment], kv: LatentKV,
                trace: ForwardTrace | None) -> torch.Tensor:
        positions, seg = segment_positions(list(segments), model.device)
        n = positions.numel()
        self.tokens[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        kv.begin_step(segments)
        out = self.pieces[0].run()
        seam = AttentionBatch(self.positions[:n], seg, kv, self.batch.cos[:n], self.batch.sin[:n], {}, trace)
        for i, layer in enumerate(model.layers):
            rows, keys, q = out[1]                       # layer i's projections
            olat = layer.seam(None if rows is None else rows[:n], None if keys is None else keys[:n],
                              _narrow(q, n), seam)
            self.olat[:n].copy_(olat)
            out = self.pieces[i + 1].run()               # (layer i's output, layer i+1's projections or logits)
            if trace is not None and i in trace.tap_layers:
                trace.taps[i] = out[0][:n].clone()
        kv.end_step()
        return out[1][:n].clone()


class DecodeGraphs:
    """Piecewise graphs of a model's decode steps of up to `max_rows` rows, at bucketed sizes (all made up front)."""

    def __init__(self, model: ML4, max_rows: int, capture: bool):
        self.model, self.capture = model, capture
        pool = torch.cuda.graph_pool_handle() if capture else None
        self.buckets: dict[int, BucketGraphs] = {}
        for size in sorted(bucket_sizes(max_rows), reverse=True):    # largest first: the others reuse its pool
            self.buckets[size] = BucketGraphs(model, size, capture, pool)
        self.max_rows = max_rows
        self.steps = 0          # decode steps run through the graphs
        if capture:
            log.info("captured piecewise CUDA graphs for decode steps of %s rows (%d pieces each)",
                     sorted(self.buckets), len(model.layers) + 1)

    def handles(self, segments: Sequence[Segment], logit_rows: Sequence[int]) -> bool:
        """A step these graphs run: every row returns its logits (a decode token, or a verify segment's anchor and
        drafts), at most max_rows rows in all. Prefill chunks, which need their last row's logits only, run the
        plain forward."""
        rows = sum(s.length for s in segments)
        return 0 < rows <= self.max_rows and all(k == s.length for s, k in zip(segments, logit_rows, strict=True))

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], kv: LatentKV,
                trace: ForwardTrace | None = None) -> torch.Tensor:
        """tokens [n] of the segments' n rows -> logits [n, V], as `ML4.forward` gives them."""
        size = min(b for b in self.buckets if b >= tokens.numel())
        self.steps += 1
        return self.buckets[size].forward(self.model, tokens, segments, kv, trace)
