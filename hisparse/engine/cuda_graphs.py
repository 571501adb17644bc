"""Piecewise CUDA graphs for decode steps (`--cuda-graph piecewise`; `full` captures the whole step instead:
full_graph.py).

A decode step of n rows (one per request, or a speculative verify segment's anchor and drafts per request) runs at
the smallest bucket size B >= n: its tokens and positions are copied into rows [:B] of the static rows (rows
n..B-1 are padding, holding whatever an earlier step left) and the forward runs as L + 1 pieces around the L KV
seams, the way vLLM's PIECEWISE mode runs attention between captured graphs:
- piece 0: embedding, rope tables and layer 0's projections (`Block.project`);
- piece i: layer i-1's output (`Block.finish`) and layer i's projections;
- piece L: the last layer's output and the head.
Each piece has the bucket's static shapes and no host synchronisation, so on CUDA it is captured once per bucket
and replayed. The seams (`Block.seam`: every LatentKV write, select and attend) run eagerly on the n real rows
between the pieces: the working set's miss path, its copy stream and its data-dependent work stay outside the
graphs. Every piece computes each row on its own (row-wise projections, per-row routing and grouped experts), so
the padding rows never reach a real row.

Without capture (`capture=False`, the CPU) the pieces run eagerly on the same static rows: tests check the
piecewise step against the plain forward, and that every piece's ops and shapes depend on the bucket only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import fields

import torch

from ..model.attention import AttentionBatch, Queries
from ..core.batch import ForwardTrace, Segment, segment_positions
from ..kv.base import LatentKV
from ..model.ml4 import ML4

log = logging.getLogger(__name__)

GRAPH_MODES = ("full", "piecewise", "off")


class GraphSettingError(ValueError):
    """`--cuda-graph` cannot be honoured as given."""


def graphs_wanted(mode: str, device: torch.device | str, kernels: str) -> str | None:
    """The decode graphs to make: 'full' (the default: the whole step, `full_graph.FullGraphs`) on CUDA with the
    Triton kernels, else none; 'piecewise' (these pieces) the same, or an error saying what is missing; 'off'
    never (None)."""
    if mode not in GRAPH_MODES:
        raise GraphSettingError(f"--cuda-graph: must be one of {list(GRAPH_MODES)}, got {mode!r}")
    missing = [why for bad, why in ((torch.device(device).type != "cuda", "a CUDA device"),
                                    (kernels != "triton", "--kernels triton (the torch MoE reads routing counts on "
                                                          "the host)")) if bad]
    if mode == "piecewise" and missing:
        raise GraphSettingError(f"--cuda-graph piecewise: needs {' and '.join(missing)}")
    return None if mode == "off" or missing else mode


def capture_graphs(model: ML4, max_rows: int, fallback: bool) -> DecodeGraphs | None:
    """Capture the piecewise decode graphs; with `fallback` (one rank) a capture that fails logs why and decode
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


PROJECTIONS = ("latents", "keys") + tuple(f.name for f in fields(Queries))   # what a layer's projections give


class RowBuffers:
    """Buffers of `rows` rows by name, made at their first (eager) use, outside any graph: a graph copies what it
    computes into rows [:B], so its own temporaries die with it (a graph pool reuses their memory)."""

    def __init__(self, rows: int):
        self.rows = rows
        self.buffers: dict[str, torch.Tensor] = {}

    def put(self, name: str, t: torch.Tensor) -> None:
        """Copy t [B, ...] into rows [:B] of buffer `name`."""
        buf = self.buffers.get(name)
        if buf is None:
            buf = self.buffers[name] = t.new_empty((self.rows, *t.shape[1:]))
        buf[:t.shape[0]].copy_(t)

    def get(self, name: str, n: int) -> torch.Tensor:
        """Rows [:n] of buffer `name`."""
        return self.buffers[name][:n]


class StaticRows(RowBuffers):
    """Row buffers shared by every bucket's pieces (a bucket of B rows uses rows [:B]; one bucket runs at a time):
    the step's tokens and positions, the rope tables, the residual stream, the current layer's projections, the
    seam's latent output and the logits. Only these rows stay allocated between pieces."""

    def __init__(self, model: ML4, rows: int):
        super().__init__(rows)
        dev = model.device
        self.tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.olat = torch.zeros(rows, model.layers[0].attention.n_heads, model.cfg.kv_lora_rank, dtype=model.dtype,
                                device=dev)


class Piece:
    """One dense region of the forward over the static rows: captured as a CUDA graph, or run eagerly."""

    def __init__(self, fn: Callable[[], None], capture: bool, pool: object | None = None):
        self.fn, self.graph = fn, None
        fn()                                                # first run: lazy weights and the buffers get made
        if capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                   # warm-up off the capturing stream, as torch advises
                fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                fn()
            self.graph.replay()                             # the rows hold values for the next piece's warm-up

    def run(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


class BucketGraphs:
    """The L + 1 pieces of one bucket size over rows [:size] of the static rows."""

    @torch.no_grad()
    def __init__(self, model: ML4, size: int, rows: StaticRows, present: dict[int, set[str]], capture: bool,
                 pool: object | None):
        B, layers = size, model.layers
        self.size, self.rows, self.present = size, rows, present
        # the pieces' batch: positions and rope tables only (the seams get their own batch of the real rows)
        self.batch = AttentionBatch(rows.positions[:B], torch.zeros_like(rows.positions[:B]), None, None, None, {})

        def project(i: int, h: torch.Tensor) -> None:
            latents, keys, q = layers[i].project(h, self.batch)
            out = dict(zip(PROJECTIONS, (latents, keys, *(getattr(q, f.name) for f in fields(Queries)))))
            present.setdefault(i, {name for name, t in out.items() if t is not None})
            for name in present[i]:
                rows.put(name, out[name])

        def first() -> None:
            cos, sin = model.rope(rows.positions[:B])
            rows.put("cos", cos)
            rows.put("sin", sin)
            self.batch.cos, self.batch.sin = rows.get("cos", B), rows.get("sin", B)
            h = model.tok_embeddings(rows.tokens[:B])
            rows.put("h", h)
            project(0, h)

        def middle(i: int) -> Callable[[], None]:
            def piece() -> None:
                h = layers[i - 1].finish(rows.get("h", B), rows.olat[:B])
                rows.put("h", h)
                project(i, h)
            return piece

        def last() -> None:
            h = layers[-1].finish(rows.get("h", B), rows.olat[:B])
            rows.put("h", h)
            rows.put("logits", model.head(h))

        self.pieces = [Piece(fn, capture, pool) for fn in [first] + [middle(i) for i in range(1, len(layers))]
                       + [last]]

    @torch.no_grad()
    def forward(self, model: ML4, tokens: torch.Tensor, segments: Sequence[Segment], kv: LatentKV,
                trace: ForwardTrace | None) -> torch.Tensor:
        rows = self.rows
        positions, seg = segment_positions(list(segments), model.device)
        n = positions.numel()
        rows.tokens[:n].copy_(tokens)
        rows.positions[:n].copy_(positions)
        kv.begin_step(segments)
        self.pieces[0].run()
        seam = AttentionBatch(rows.positions[:n], seg, kv, rows.get("cos", n), rows.get("sin", n), {}, trace)
        for i, layer in enumerate(model.layers):
            p = {name: rows.get(name, n) if name in self.present[i] else None for name in PROJECTIONS}
            q = Queries(*(p[f.name] for f in fields(Queries)))
            rows.olat[:n].copy_(layer.seam(p["latents"], p["keys"], q, seam))
            self.pieces[i + 1].run()                     # layer i's output (and layer i+1's projections)
            if trace is not None and i in trace.tap_layers:
                trace.taps[i] = rows.get("h", n).clone()
        kv.end_step()
        return rows.get("logits", n).clone()


class DecodeGraphs:
    """Piecewise graphs of a model's decode steps of up to `max_rows` rows, at bucketed sizes (all made up front)."""

    def __init__(self, model: ML4, max_rows: int, capture: bool):
        self.model = model
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if capture else None
        self.rows = StaticRows(model, max_rows)
        present: dict[int, set[str]] = {}     # layer -> the projections it has (its LayerSpec decides)
        self.buckets: dict[int, BucketGraphs] = {}
        for size in sorted(bucket_sizes(max_rows), reverse=True):    # largest first: the others reuse its pool
            self.buckets[size] = BucketGraphs(model, size, self.rows, present, capture, pool)
        self.max_rows = max_rows
        self.steps = 0          # decode steps run through the graphs
        if capture:
            log.info("captured piecewise CUDA graphs for decode steps of %s rows (%d pieces each) in %.1f s",
                     sorted(self.buckets), len(model.layers) + 1, time.perf_counter() - t0)

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
