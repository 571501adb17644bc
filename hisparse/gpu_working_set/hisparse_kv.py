"""HiSparseKV: the LatentKV whose rows live in the host pool, with a small working set on the device.

Per request the device holds: this step's new rows (until the step ends), a resident window (newest W and
first S tokens per KV-owning layer), one hot buffer of N slots per layer (metadata shared by an index
group), and the indexer keys. A gather serves each position from the step rows, the window, a hot slot, or
the host pool (a miss). The index-group owner resolves the plan for all its followers and prefetches their
misses at once, so the followers' copies overlap the owner's attention. Rows are the same bytes ResidentKV
stores, so outputs are bit-identical with HiSparse on and off.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from ..host_pool.pool import HostPool
from ..model.config import ModelConfig
from ..model.kv import LatentKV
from .copier import Copier
from .resident import ResidentWindow, WindowBounds
from .resolver import HotState, Plan, resolve

DEFAULT_WINDOW = 64
DEFAULT_SINKS = 4


@dataclass
class GroupStep:
    """One (request, index group) in one step: its positions [U], which of them were written this step, and
    each member layer's rows (window + hot + misses, filled at the owner) with the event to wait on."""
    positions: torch.Tensor
    start: int                                   # first position written this step
    step_idx: torch.Tensor                       # indices into positions of rows written this step
    n_misses: int = 0
    rows: dict[int, tuple[torch.Tensor, object | None]] = field(default_factory=dict)


class HiSparseKV(LatentKV):
    def __init__(self, cfg: ModelConfig, layout: str = "fp8_ds_mla", device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, host_pool_gib: float = 4.0,
                 hot_buffer_tokens: int | None = None, resident_window: int | None = None,
                 sink_tokens: int = DEFAULT_SINKS, page_tokens: int = 64):
        if layout is None:
            raise ValueError("kv_layout: HiSparse stores packed rows; choose 'fp8_ds_mla' or 'bf16'")
        super().__init__(cfg, layout, device, dtype)
        self.pool = HostPool(cfg, self.layout, host_pool_gib, page_tokens)
        self.page_tokens = page_tokens
        self.n_slots = hot_buffer_tokens if hot_buffer_tokens is not None else 2 * cfg.index_topk
        self.window = DEFAULT_WINDOW if resident_window is None else resident_window
        self.sinks = sink_tokens
        if self.n_slots < 0 or self.window < 0 or self.sinks < 0:
            raise ValueError("hot_buffer_tokens, resident_window and sink tokens must be >= 0")
        self.copier = Copier(self.device)
        self.members = {o: [l.index for l in cfg.layers if l.index_source == o] for o in cfg.index_owner_layers}
        self.bounds: dict[Hashable, WindowBounds] = {}
        self.windows: dict[tuple[int, Hashable], ResidentWindow] = {}     # (kv owner layer, req)
        self.hot_state: dict[tuple[int, Hashable], HotState] = {}         # (index group, req)
        self.hot_data: dict[tuple[int, Hashable], torch.Tensor] = {}      # (layer, req) -> [N, row_bytes]
        self.step_rows: dict[tuple[int, Hashable], torch.Tensor] = {}     # (kv owner layer, req) -> [T, B]
        self.step_start: dict[Hashable, int] = {}
        self.step_end: dict[Hashable, int] = {}
        self.groups: dict[tuple[int, Hashable], GroupStep] = {}
        self.step = 0

    # ---- capacity ----
    def token_capacity(self) -> int:
        return self.pool.token_capacity

    # ---- step lifecycle ----
    def begin_step(self, segments: list) -> None:
        for seg in segments:   # allocate first: an exhausted pool fails before any row of the step is written
            self.pool.ensure(seg.req, seg.start + seg.length)
        self.step += 1
        self.stats.steps += 1
        self.groups.clear()
        self.step_rows.clear()
        self.step_start.clear()
        self.step_end.clear()

    def end_step(self) -> None:
        self.copier.flush()
        for (layer, req), data in self.step_rows.items():
            start = self.step_start[req]
            positions = torch.arange(start, start + data.shape[0], device=self.device)
            self.window_of(layer, req).store(positions, data)
        for req, end in self.step_end.items():
            self.bounds[req].advance(end)
        self.step_rows.clear()
        self.groups.clear()

    def window_of(self, layer: int, req: Hashable) -> ResidentWindow:
        w = self.windows.get((layer, req))
        if w is None:
            w = self.windows[(layer, req)] = ResidentWindow(self.window, self.sinks, self.layout.row_bytes,
                                                            self.device)
        return w

    # ---- LatentKV ----
    def write(self, layer: int, req: Hashable, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """New rows of this step: kept on the device for the step, backed up to the host pool eagerly."""
        data = self.encode(rows).to(self.device)
        start = int(positions[0])
        if self.step_start.setdefault(req, start) != start:
            raise ValueError(f"request {req!r}: one contiguous segment per step (got start {start})")
        self.bounds.setdefault(req, WindowBounds(self.window, self.sinks))
        self.step_end[req] = int(positions[-1]) + 1
        self.pool.ensure(req, self.step_end[req])
        self.step_rows[(layer, req)] = data
        host_rows = self.pool.rows_of(req, positions.cpu())
        view = self.pool.layer_view(layer)
        self.copier.backup(data, lambda d, v=view, r=host_rows: v.index_put_((r,), d.cpu()))
        self.stats.device_to_host_bytes += data.numel()

    def gather(self, layer: int, req: Hashable, positions: torch.Tensor) -> torch.Tensor:
        """Rows [n, r + dR] of sorted unique positions [n]: the group owner's, or (a member past the rows the
        forward narrowed to, see AttentionBatch.narrow_) a subset of them."""
        group = self.cfg.layers[layer].index_source
        positions = positions.to(self.device)
        g = self.groups.get((group, req))
        if g is None:
            g = self.groups[(group, req)] = self.plan_group(group, req, positions)
        subset = None
        if not torch.equal(g.positions, positions):
            subset = torch.searchsorted(g.positions, positions).clamp(max=max(0, g.positions.numel() - 1))
            if not g.positions.numel() or not torch.equal(g.positions[subset], positions):
                raise RuntimeError(f"layer {layer}: selection is not within its index group owner {group}'s")
        rows, event = g.rows.pop(layer)
        self.copier.wait(event)
        if g.step_idx.numel():     # rows written earlier in this very forward
            rows[g.step_idx] = self.step_rows[(self.source(layer), req)][g.positions[g.step_idx] - g.start]
        if subset is not None:
            rows = rows[subset]
        self.stats.hits += g.positions.numel() - g.n_misses
        self.stats.misses += g.n_misses
        self.stats.host_to_device_bytes += g.n_misses * self.layout.row_bytes
        return self.decode(rows)

    def plan_group(self, group: int, req: Hashable, positions: torch.Tensor) -> GroupStep:
        """At the index group owner: split positions into this step's rows, resident window and the rest;
        resolve the rest against the group's hot buffer once; issue every member's window reads and miss
        copies now, so the followers' copies overlap the owner's attention."""
        bounds = self.bounds.get(req)
        start = self.step_start.get(req, bounds.length if bounds is not None else 0)
        in_step = positions >= start
        in_win = ~in_step & bounds.contains(positions) if bounds is not None else torch.zeros_like(in_step)
        rest = ~(in_step | in_win)
        g = GroupStep(positions, start, in_step.nonzero().squeeze(1))
        win_idx, rest_idx = in_win.nonzero().squeeze(1), rest.nonzero().squeeze(1)
        plan = None
        if rest_idx.numel():
            state = self.hot_state.get((group, req))
            if state is None:
                state = self.hot_state[(group, req)] = HotState(self.n_slots, self.device)
            plan = resolve(state, positions[rest_idx], self.step)
            g.n_misses = plan.n_misses
        for member in self.members[group]:
            src = self.source(member)
            out = torch.empty(positions.numel(), self.layout.row_bytes, dtype=torch.uint8, device=self.device)
            with self.copier.side() as done:
                if win_idx.numel():
                    out[win_idx] = self.window_of(src, req).read(positions[win_idx])
                if plan is not None:
                    out[rest_idx] = self.fetch(member, req, plan)
            g.rows[member] = (out, done[0] if done else None)
            if member != group:
                self.stats.overlapped_copies += g.n_misses
        return g

    def fetch(self, layer: int, req: Hashable, plan: Plan) -> torch.Tensor:
        """One layer's rows for a plan (call on the copy stream): hits from its hot slots, misses copied
        host -> device and into their LRU slots."""
        data = self.hot_data.get((layer, req))
        if data is None:
            data = self.hot_data[(layer, req)] = torch.zeros(self.n_slots, self.layout.row_bytes,
                                                             dtype=torch.uint8, device=self.device)
        miss = ~plan.hit
        fetched = self.copier.to_device(self.pool.layer_view(layer), self.pool.rows_of(req, plan.positions[miss]))
        out = torch.empty(plan.positions.numel(), self.layout.row_bytes, dtype=torch.uint8, device=self.device)
        out[plan.hit] = data[plan.slot[plan.hit]]
        out[miss] = fetched
        data[plan.fill_slots] = fetched[: plan.fill_slots.numel()]
        return out

    def truncate(self, req: Hashable, length: int) -> None:
        if req in self.bounds:
            self.bounds[req].truncate(length)
        for (group, r), state in self.hot_state.items():
            if r == req:
                state.drop_from(length)

    def release(self, req: Hashable) -> None:
        super().release(req)
        self.pool.free(req)
        self.bounds.pop(req, None)
        for d in (self.windows, self.hot_state, self.hot_data):
            for key in [k for k in d if k[1] == req]:
                del d[key]

    # ---- observability ----
    def device_bytes(self, req: Hashable) -> dict[str, int]:
        """Device memory one request holds, by part (latent = window + hot slots; the rest is metadata)."""
        window = sum(w.nbytes() for (l, r), w in self.windows.items() if r == req)
        hot = sum(d.numel() for (l, r), d in self.hot_data.items() if r == req)
        meta = sum(s.nbytes() for (g, r), s in self.hot_state.items() if r == req)
        return {"latent": window + hot, "hot_metadata": meta, "index_keys": self.index_cache.nbytes(req)}
