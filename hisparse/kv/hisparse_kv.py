"""HiSparseKV: the LatentKV whose rows live in the host pool, with a small working set on the device.

Per request slot the device arena (`arena.DeviceArena`) holds a resident window (newest W and first S tokens
per KV-owning layer) and one hot buffer of N slots per layer (LRU metadata shared by an index group); this
step's new rows sit in the arena's step region until the step ends; indexer keys live in the paged key store.
Every seam call covers the whole batch: `write` stores every request's new rows (and backs them up to the host
pool), and the first `gather` of an index group resolves every request's selections at once (`resolver.resolve`)
and copies all misses of every member layer from the host pool in one index_select per layer, so the
followers' copies overlap the owner's attention. A gather is then one index into the arena. With
`kernels='triton'` one miss-path launch per index group does the resolve, the copies and the indexing
(`stored_rows`). Rows are the same bytes ResidentKV stores, so outputs are bit-identical with HiSparse on and off
(on either kernel path).

Device memory (`device_kv_gib`, `device_budget.DeviceBudget`): one budget for every request's working set and,
under hybrid offload, resident pages in what the working sets leave: device copies of host-pool pages kept while
there is room (`hybrid.HybridPages`).

A static step (full-step CUDA graphs: `begin_step` with static inputs) runs the same calls with shapes fixed by
the step's shape and no host read: the resolver of `static_plan`, counters on the device, window bounds and LRU
state updated in place.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from ..host_pool.pages import paged_rows, span_rows
from ..host_pool.pool import HostPool
from ..core.config import ModelConfig
from ..core.batch import PAD
from ..core.step_inputs import StepInputs
from .geometry import row_layout
from .base import ATTEND_BLOCK_ELEMS, LatentKV, RowSource
from .device_budget import DeviceBudget
from .hybrid import HybridPages
from ..gpu_working_set.arena import DeviceArena
from ..gpu_working_set.copier import Copier
from ..gpu_working_set.resident_pages import ResidentPages
from ..gpu_working_set.resolver import EXTRA, HotSlots, Plan, resolve
from ..gpu_working_set.static_plan import StaticPlan, resolve_static

if TYPE_CHECKING:
    from ..gpu_working_set.kernels.miss_path_triton import MissPath

DEFAULT_WINDOW = 64
DEFAULT_SINKS = 4
STATS_EVERY = 16   # static steps: the device counters are read once per this many steps


class HiSparseKV(DeviceBudget, HybridPages, LatentKV):
    def __init__(self, cfg: ModelConfig, layout: str = "fp8_ds_mla", device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, host_pool_gib: float = 4.0,
                 hot_buffer_tokens: int | None = None, resident_window: int | None = None,
                 sink_tokens: int = DEFAULT_SINKS, page_tokens: int = 64, kernels: str = "torch",
                 index_cache: str = "fp32", device_kv_gib: float | None = None, hybrid: bool = True,
                 prefix_caching: bool = False):
        """device_kv_gib: the device budget of working sets and (`hybrid`) resident pages (None: unbounded working
        sets, no resident pages)."""
        if layout is None:
            raise ValueError("kv_layout: HiSparse stores packed rows; choose 'fp8_ds_mla' or 'bf16'")
        n_slots = hot_buffer_tokens if hot_buffer_tokens is not None else 2 * cfg.index_topk
        window = DEFAULT_WINDOW if resident_window is None else resident_window
        if n_slots < 0 or window < 0 or sink_tokens < 0:
            raise ValueError("hot_buffer_tokens, resident_window and sink tokens must be >= 0")
        pool = HostPool(row_layout(cfg, layout), cfg.kv_source_layers, host_pool_gib, page_tokens)
        super().__init__(cfg, layout, device, dtype, pool.pages, kernels, index_cache, prefix_caching)
        self.pool, self.n_slots, self.window, self.sinks = pool, n_slots, window, sink_tokens
        self.copier = Copier(self.device)
        self.members = {o: [l.index for l in cfg.layers if l.index_source == o] for o in cfg.index_owner_layers}
        self.page_bytes = page_bytes = pool.page_bytes     # one page of every KV owner, as the arena holds it
        self.budget = None if device_kv_gib is None else int(device_kv_gib * (1 << 30))
        # hybrid: resident pages, at most the budget's worth (None: every row outside the window from the host pool)
        n_pages = 0 if self.budget is None or not hybrid else self.budget // page_bytes
        self.resident = ResidentPages(n_pages, self.device) if n_pages else None
        self.placed: dict[Hashable, int] = {}   # request -> how many of its pages were offered a device page
        self.page_count: dict[Hashable, tuple[int, int, int]] = {}   # request -> (map version, pages, resident)
        self.resident_split: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # group -> (selection, page rows)
        self.seg_pages: torch.Tensor | None = None   # per step: [S, max_pages] device page (-1: host only)
        self.all_resident = False   # per step: every page of every request of the step is resident
        self.writes_pages = False   # per step: some of its rows go to resident pages (hybrid.py)
        self.stale_windows: set[Hashable] = set()   # requests whose windows missed all-resident decode steps
        self.resident_decode = False   # per step: all-resident decode, read from the pages, windows left as they are
        self.arena = DeviceArena({l.index: l.kv_source for l in cfg.layers}, n_slots, window, sink_tokens,
                                 self.layout.row_bytes, self.device)
        self.hot = {g: HotSlots(n_slots, self.device) for g in cfg.index_owner_layers}
        self.check_budget()
        self.slot_of: dict[Hashable, int] = {}       # request -> its slot in the arena and the hot metadata
        self.free_slots: list[int] = []
        self.win_lo = torch.zeros(0, dtype=torch.long, device=self.device)    # [R] resident window [lo, len)
        self.win_len = torch.zeros(0, dtype=torch.long, device=self.device)
        self.step = 0
        self.step_slot = self.step_row0 = None        # [S] per segment: request slot, first row in the step region
        self.step_rows: tuple[torch.Tensor, torch.Tensor] | None = None   # (seg, positions) of this step's writes
        self.step_host_rows: torch.Tensor | None = None   # their rows in a host-pool layer view (host tensor)
        self.step_page_rows: torch.Tensor | None = None   # their rows within a page region (-1: host only)
        self.step_page_dest: torch.Tensor | None = None   # [O, n] their arena rows there, every KV owner
        self.owner_index = {o: i for i, o in enumerate(self.arena.owners)}
        # where each KV owner's layer view starts in pool.rows, in the arena's owner order [O, 1] (host)
        self.owner_pool_base = torch.tensor([[pool.layer_offset(o)] for o in self.arena.owners], dtype=torch.long)
        self.plans: dict[int, Plan] = {}
        self.located: tuple[torch.Tensor, torch.Tensor] | None = None   # (selection, its plan entries)
        self.fetched: dict[int, tuple[torch.Tensor, object | None]] = {}   # layer -> (its misses' rows, event)
        # Triton path: index group -> (the selection its miss path ran on, the result), and the step's hits,
        # misses and overlapped copies counted on the device (read once, at end_step)
        self.kernel_plans: dict[int, tuple[torch.Tensor, MissPath]] = {}
        self.kernel_counts = torch.zeros(4, dtype=torch.long, device=self.device)
        self.pool_offsets = {g: torch.tensor([pool.layer_offset(m) for m in ms], dtype=torch.long, device=self.device)
                             for g, ms in self.members.items()}       # where each member's rows start in pool.rows
        self.static = False     # per step: a static step (full-step graphs), see `stage`
        self.stamp = self.real = None    # per step on the device: the LRU stamp, [S] 1 for a real segment
        self.max_rows = 0       # the most query rows one segment of this step has
        self.step_context = 0   # positions the step's requests hold in all (the sum of their ends)
        self.step_pool_rows: torch.Tensor | None = None   # step_host_rows on the device (Triton backups)

    # ---- capacity ----
    def token_capacity(self) -> int:
        return self.pool.token_capacity

    # ---- step lifecycle ----
    def stage(self, segments: Sequence, query_rows: Sequence[int] | None, inputs: StepInputs) -> None:
        """Request slots, the step region's and host pool's rows of the step's writes, the LRU stamp and (hybrid)
        page placement; a static step (full-step graphs: `inputs.static`) runs the seam without host branches."""
        self.static = inputs.static
        # write() receives the step's rows in this flat order (segment by segment, positions ascending), so their
        # step-region rows and host-pool rows are known here, on the host (plain lists: a step's few rows)
        P, tables = self.page_tokens, self.pages.tables
        slots, row0, rows = [], [], []
        for seg in segments:
            slots.append(self.slot_for(seg.req))
            row0.append(len(rows))
            pages = tables.get(seg.req, ())     # (a DCP rank may hold none of a short request)
            rows += span_rows(pages, seg.start, seg.start + seg.length, P)
        self.fit_slots(max(self.slot_of.values(), default=-1) + 1, len(rows))
        self.step_host_rows = torch.tensor(rows, dtype=torch.long)
        self.max_rows = max(query_rows if query_rows is not None else (s.length for s in segments), default=0)
        self.step_context = sum(s.start + s.length for s in segments)
        self.step += 1
        self.stats.steps += 1
        inputs.stage("slot", torch.tensor(slots, dtype=torch.long))
        inputs.stage("row0", torch.tensor(row0, dtype=torch.long))
        inputs.stage("pool_rows", self.step_host_rows)
        inputs.stage("stamp", torch.tensor(self.step))
        if self.static:      # (only a static step has padding segments)
            inputs.stage("real", torch.tensor([s.req is not PAD for s in segments]))
        rows = sum(s.length for s in segments if s.req is not PAD)
        self.stats.device_to_host_bytes += rows * self.layout.row_bytes * len(self.arena.owners)
        if self.resident is not None:     # padding never takes a device page; a DCP rank may hold no page of a request
            self.place_pages([s for s in segments if s.req is not PAD and s.req in tables])
        self.forget_step()

    def forget_step(self) -> None:
        self.step_rows = self.step_page_rows = self.step_page_dest = self.located = self.seg_pages = None
        self.plans.clear()
        self.fetched.clear()
        self.kernel_plans.clear()
        self.resident_split.clear()

    def device_buffers(self) -> list[torch.Tensor]:
        res = [] if self.resident is None else [self.resident.slot_of, self.resident.stamp]
        return (super().device_buffers() + [self.arena.data, self.win_lo, self.win_len, self.kernel_counts] + res
                + [t for h in self.hot.values() for t in (h.pos, h.stamp, h.key_base)])

    def bind(self, views: dict[str, torch.Tensor]) -> None:
        self.step_slot, self.step_row0, self.step_pool_rows = views["slot"], views["row0"], views["pool_rows"]
        self.stamp, self.real = views["stamp"], views.get("real")

    def load_rows(self, host_rows: torch.Tensor, base: dict[int, int], dest: torch.Tensor) -> None:
        """Copy host-pool rows host_rows [n] (a layer view's rows) of every KV owner to arena rows base[owner] +
        dest [n]."""
        if self.kernels == "triton" and self.device.type == "cuda":   # backups are written by device kernels
            torch.cuda.current_stream(self.device).synchronize()
        a = self.arena
        for owner in a.owners:
            a.data.index_copy_(0, base[owner] + dest, self.copier.to_device(self.pool.layer_view(owner), host_rows))

    def attached(self, req: Hashable, n_tokens: int, keys: list[bytes]) -> None:
        """A request starting from n_tokens cached positions: its sinks and resident window come from the host
        pool (the resolver reads positions < sinks and in [lo, len) from there); its cached pages are not
        offered new device pages (nothing writes them), they come back through `readmit` while pages are free."""
        slot = self.slot_for(req)
        self.fit_slots(slot + 1, self.arena.step_cap)
        self.load_window(req, n_tokens)
        self.placed[req] = self.pages.pages_of(req)

    def load_window(self, req: Hashable, n_tokens: int) -> None:
        """A request's sinks and resident window over its first n_tokens positions, from the host pool."""
        slot = self.slot_of[req]
        ends = (min(self.sinks, n_tokens), max(self.sinks, n_tokens - self.window))
        pos = torch.cat((torch.arange(ends[0]), torch.arange(ends[1], n_tokens)))
        rows = paged_rows(self.pages.page_ids[req][None], torch.zeros_like(pos), pos, self.page_tokens)
        self.load_rows(rows, self.arena.win_base, self.arena.window_index(torch.tensor(slot), pos).to(self.device))
        self.win_len[slot] = n_tokens
        self.win_lo[slot] = max(0, n_tokens - self.window)
        self.stale_windows.discard(req)

    def end_step_device(self) -> None:
        """Back the step's new rows up to the host pool (torch path: every KV-owning layer's in one copy), move the
        newest into the resident windows (one gather and one scatter for every KV-owning layer at once; `write`
        put them in their resident pages), and advance every written request's window bounds (in place: a captured step replays on the same tensors). An eager all-resident
        decode step only backs its rows up (hybrid.py: `resident_decode`)."""
        if self.step_rows is None:
            return
        seg, pos = self.step_rows
        a = self.arena
        if self.resident_decode:     # the rows are in their pages; the windows are loaded when a step needs them
            if self.kernels != "triton":
                self.back_up(a.gather(a.owner_page_base + self.step_page_rows))
            return
        slot, end = self.step_slot[seg], self.tables.end[seg]
        # [O, n, B]: from the step region, or from their resident pages when the step wrote only those
        src = a.gather(a.owner_page_base + self.step_page_rows if self.all_resident else
                       a.owner_step_base + torch.arange(pos.numel(), device=self.device))
        if self.kernels != "triton":     # (the Triton path's backup kernel wrote them during the step)
            self.back_up(src)
        # sink positions go to their sink rows, the segment's newest W others to their ring rows (p % W)
        keep = (pos < self.sinks) | (pos >= end - self.window) if self.window else pos < self.sinks
        dest = torch.where(keep, a.owner_win_base + a.window_index(slot, pos), a.scratch_row)    # [O, n]
        a.data.index_copy_(0, dest.flatten(), src.flatten(0, 1))
        written = torch.zeros_like(self.win_len).scatter_reduce_(0, slot, end, "amax")
        torch.maximum(self.win_len, written, out=self.win_len)
        torch.maximum(self.win_lo, self.win_len - self.window, out=self.win_lo)

    def back_up(self, src: torch.Tensor) -> None:
        """Copy the step's rows src [O, n, B] to the host pool (torch path). The pool's rows are addressed from the
        host on CUDA, from the step's inputs on the CPU (where the pool and the inputs share the device, so a
        static step reads the same tensor every time)."""
        rows = (self.owner_pool_base + (self.step_host_rows if self.copier.cuda else self.step_pool_rows))
        self.copier.backup(src.flatten(0, 1), lambda d: self.pool.rows.index_copy_(0, rows.flatten(), d.cpu()))
        self.copier.flush()

    def end_step_host(self) -> None:
        """Forget the step's per-layer state; fold the device counters into `stats` every step (eager) or every
        STATS_EVERY steps (static steps: no host read on most steps)."""
        self.forget_step()
        self.step_host_rows = None
        if not self.static or self.step % STATS_EVERY == 0:
            self.sync_stats()

    def sync_stats(self) -> None:
        """Fold the device counters (hits, misses, overlapped copies, resident hits) into `stats`: one read."""
        hits, misses, overlapped, resident = self.kernel_counts.tolist()
        self.kernel_counts.zero_()
        self.stats.hits += hits
        self.stats.misses += misses
        self.stats.overlapped_copies += overlapped
        self.stats.host_to_device_bytes += misses * self.layout.row_bytes
        self.stats.resident_hits += resident

    # ---- the batch seam ----
    def write(self, layer: int, seg: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """This step's new rows of every request: into the arena's step region (read by this step's gathers,
        moved into the windows and backed up to the host pool at end_step; the Triton path backs them up now) and
        into their resident pages (hybrid; a step whose every page is resident writes only those)."""
        data = self.encode(rows).to(self.device)
        a = self.arena
        if self.step_rows is None:    # the same rows every KV-owning layer
            self.step_rows = (seg, positions)
            if self.writes_pages:     # their rows within a page region (-1: host only), once per step
                d = self.page_map().page_of(seg, positions)
                self.step_page_rows = torch.where(d >= 0, d * self.page_tokens + positions % self.page_tokens, -1)
                # [O, n] every KV owner's arena rows of them (host-only positions: the scratch row)
                self.step_page_dest = (a.owner_page_base + self.step_page_rows if self.all_resident else
                                       torch.where(self.step_page_rows >= 0, a.owner_page_base + self.step_page_rows,
                                                   a.scratch_row))
        if not self.all_resident:        # (a step whose every page is resident reads and keeps them there only)
            a.data[a.step_base[layer]: a.step_base[layer] + data.shape[0]] = data
        if self.writes_pages:             # and into the positions' resident pages
            a.data.index_copy_(0, self.step_page_dest[self.owner_index[layer]], data)
        if self.kernels == "triton":      # straight into the pool, ordered before the next step's miss path
            from ..gpu_working_set.kernels.backup_triton import backup
            backup(data, self.pool.rows, self.step_pool_rows + self.pool.layer_offset(layer))

    def gather(self, layer: int, seg: torch.Tensor, sel: torch.Tensor) -> RowSource:
        """Every query row's selected rows: one index into the arena (plus this step's transient misses)."""
        if self.kernels == "triton":
            store, idx, extra = self.stored_rows(layer, seg, sel)
            n = store.shape[0]

            def stored(lo: int, hi: int) -> torch.Tensor:
                out = self.layout.gather_unpack(store, idx[lo:hi].clamp(0, n - 1), self.dtype)
                if extra is not None:   # transient misses: rows idx - n of this step's extra rows
                    fresh = self.layout.gather_unpack(extra, (idx[lo:hi] - n).clamp(min=0), self.dtype)
                    out = torch.where((idx[lo:hi] >= n)[..., None], fresh, out)
                return out
            return stored
        a = self.arena
        if self.resident_decode:     # every row of the step is resident: one index into the page region
            idx = self.rows_on_pages(layer, seg, sel, None)
            return lambda lo, hi: self.layout.gather_unpack(a.data, idx[lo:hi], self.dtype)
        group = self.cfg.layers[layer].index_source
        plan = self.plans.get(group)
        if plan is None:
            plan = self.plans[group] = (self.plan_static if self.static else self.plan_group)(group, seg, sel)
        extra, event = self.fetched.pop(layer)
        self.copier.wait(event)
        if self.located is None or self.located[0] is not sel:   # members of a group share the selection
            self.located = (sel, plan.locate(seg, sel))
        j = self.located[1]
        entry_rows = plan.local + a.kind_base[layer][plan.kind]                                 # [E + 1]
        if not self.static:       # (a static plan counts on the device)
            self.stats.hits += plan.n_unique - plan.n_resident - plan.n_misses
            self.stats.resident_hits += plan.n_resident
            self.stats.misses += plan.n_misses
            self.stats.host_to_device_bytes += plan.n_misses * self.layout.row_bytes
            distinct = plan.n_unique + 1          # the selected positions and the empty selection's NO_KEY
            if 2 * distinct <= j.numel() and distinct * self.cfg.latent_dim <= ATTEND_BLOCK_ELEMS:
                return self.decoded_once(plan, entry_rows, extra, j, distinct)
        idx = entry_rows[j]                                                                     # [n, k]
        transient = (plan.kind[j] == EXTRA) if plan.n_transient else None

        def rows(lo: int, hi: int) -> torch.Tensor:
            out = self.layout.gather_unpack(a.data, idx[lo:hi], self.dtype)
            if transient is not None:   # rows copied for this step only (the arena index read the zero row)
                fresh = self.layout.gather_unpack(extra, plan.extra[j[lo:hi]].clamp(min=0), self.dtype)
                out = torch.where(transient[lo:hi, :, None], fresh, out)
            return out
        return rows

    def decoded_once(self, plan: Plan, entry_rows: torch.Tensor, extra: torch.Tensor | None, j: torch.Tensor,
                     distinct: int) -> RowSource:
        """Every distinct selected row decoded once, then indexed by each query row that selected it: a prefill
        chunk's queries share most of their selections (needle-ml4 at 256k tokens: ~33k distinct rows per layer for
        4,096 queries x 64 keys). entry_rows [E + 1]: each plan entry's arena row; j [n, k]: the selections'
        entries (each the first of its key, as `locate` finds them); `distinct` keys among the entries."""
        keys = plan.keys
        first = torch.ones_like(keys, dtype=torch.bool)
        first[1:] = keys[1:] != keys[:-1]
        group = torch.cumsum(first, 0) - 1                                       # [E + 1] each entry's key, 0..
        head = torch.full((distinct,), keys.numel(), dtype=torch.long, device=keys.device).scatter_reduce_(
            0, group, torch.arange(keys.numel(), device=keys.device), "amin")   # [distinct] first entry of each
        decoded = self.layout.gather_unpack(self.arena.data, entry_rows[head], self.dtype)   # [distinct, r + dR]
        if plan.n_transient:      # rows copied for this step only (the arena index read the zero row)
            fresh = self.layout.gather_unpack(extra, plan.extra[head].clamp(min=0), self.dtype)
            decoded = torch.where((plan.kind[head] == EXTRA)[:, None], fresh, decoded)
        at = group[j]                                                                          # [n, k]
        # index_select copies whole rows, where advanced indexing copies element by element
        return lambda lo, hi: decoded.index_select(0, at[lo:hi].flatten()).view(hi - lo, at.shape[1], -1)

    def stored_rows(self, layer: int, seg: torch.Tensor, sel: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The Triton path: at the index group owner's first call of the step, one miss-path launch resolves
        every request's selections, copies every member layer's misses from the host pool and returns the arena
        rows of every selection; members then read their own."""
        a = self.arena
        if self.resident_decode:     # every row of the step is resident: no miss path
            return a.data, self.rows_on_pages(layer, seg, sel, -1), None
        group = self.cfg.layers[layer].index_source
        if group not in self.kernel_plans:
            self.run_miss_path(group, seg, sel)
        launched, out = self.kernel_plans[group]
        i = self.members[group].index(layer)
        extra = None if out.extra is None else out.extra[i]
        # a member past the narrowed rows (AttentionBatch.narrow_) reads a subset of the planned rows, by key
        idx = out.idx[i] if sel is launched else out.rows_of(seg, sel, a.kind_base[layer], a.data.shape[0])
        return a.data, idx, extra

    def run_miss_path(self, group: int, seg: torch.Tensor, sel: torch.Tensor) -> None:
        """One miss-path launch for the index group's selection `sel` (members find the result by it)."""
        from ..gpu_working_set.kernels.miss_path_triton import miss_path   # imports triton: only on the Triton path
        a, members = self.arena, self.members[group]
        out = miss_path(self.hot[group], self.step_slot, self.tables.start, self.step_row0, self.win_lo,
                        self.win_len, self.sinks, self.window, seg, sel, self.stamp, self.tables.pages,
                        self.page_tokens, self.pool.rows, self.pool_offsets[group], a.data,
                        torch.stack([a.kind_base[m] for m in members]), max_rows_per_seg=self.max_rows,
                        resident=self.page_map())
        self.kernel_plans[group] = (sel, out)
        counts = out.counts if self.real is None else out.counts * self.real[:, None]   # padding not counted
        self.count_plan(group, *counts.sum(0))

    def count_plan(self, group: int, unique: torch.Tensor, misses: torch.Tensor, resident: torch.Tensor) -> None:
        """Add an index group's device counts (distinct positions, misses, resident positions) for every member
        layer to the device counters (hits, misses, overlapped copies, resident hits)."""
        n = len(self.members[group])
        self.kernel_counts += torch.stack((n * (unique - misses - resident), n * misses, (n - 1) * misses,
                                           n * resident))

    def plan_static(self, group: int, seg: torch.Tensor, sel: torch.Tensor) -> StaticPlan:
        """`plan_group` of a static step (CPU: the pool is on the device): every entry's host row is fetched and
        the misses' rows fill their hot slots (the others land in the scratch row), counted on the device."""
        a, members = self.arena, self.members[group]
        plan = resolve_static(self.hot[group], self.step_slot, self.tables.start, self.step_row0, self.win_lo,
                              self.win_len, self.sinks, self.window, seg, sel, self.stamp, self.real,
                              self.max_rows * sel.shape[1] > self.n_slots, self.page_map())
        host_rows = paged_rows(self.tables.pages, plan.seg, plan.pos, self.page_tokens)
        filled = plan.fill_dest >= 0
        for member in members:
            fetched = torch.index_select(self.pool.layer_view(member), 0, host_rows)
            a.data.index_copy_(0, torch.where(filled, a.hot_base[member] + plan.fill_dest, a.scratch_row), fetched)
            self.fetched[member] = (fetched, None)
        self.count_plan(group, *plan.counts)
        return plan

    def plan_group(self, group: int, seg: torch.Tensor, sel: torch.Tensor) -> Plan:
        """At the index group owner: resolve every request's selections once, then copy every member layer's
        misses from the host pool now (side stream on CUDA), so the followers' copies overlap the owner's
        attention."""
        plan = resolve(self.hot[group], self.step_slot, self.tables.start, self.step_row0, self.win_lo,
                       self.win_len, self.sinks, self.window, seg, sel, self.step, self.page_map())
        a = self.arena
        host_rows = paged_rows(self.tables.pages, plan.miss_seg, plan.miss_pos, self.page_tokens).cpu()
        for member in self.members[group]:
            with self.copier.side() as done:
                self.copier.read_on_side(plan.miss_dest, a.data)     # made on the main stream
                fetched = self.copier.to_device(self.pool.layer_view(member), host_rows)
                dest = torch.where(plan.miss_dest >= 0, a.hot_base[member] + plan.miss_dest, a.scratch_row)
                a.data.index_copy_(0, dest, fetched)
            self.copier.read_on_main(fetched)                         # made on the side stream
            self.fetched[member] = (fetched, done[0] if done else None)
            if member != group:
                self.stats.overlapped_copies += plan.n_misses
        return plan

    # ---- request lifecycle ----
    def truncate(self, req: Hashable, length: int) -> None:
        slot = self.slot_of.get(req)
        if slot is None:
            return
        self.win_len[slot] = torch.clamp(self.win_len[slot], max=length)
        for h in self.hot.values():
            h.clear(slot, length)

    def release(self, req: Hashable) -> None:
        if self.resident is not None:   # pages another request still holds stay resident
            self.resident.release(self.pages.held_only_by(req))
            self.placed.pop(req, None)
            self.page_count.pop(req, None)
            self.stale_windows.discard(req)
        super().release(req)
        slot = self.slot_of.pop(req, None)
        if slot is not None:
            for h in self.hot.values():
                h.clear(slot)
            self.win_lo[slot] = 0
            self.win_len[slot] = 0
            self.free_slots.append(slot)

    def slot_for(self, req: Hashable) -> int:
        """The request's slot in the arena and the hot metadata (a free one on its first call)."""
        if req not in self.slot_of:
            self.slot_of[req] = self.free_slots.pop() if self.free_slots else len(self.slot_of)
        return self.slot_of[req]
