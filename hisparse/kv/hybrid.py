"""Hybrid offload: device memory as a cache of the host pool (`--kv-offload hybrid`, `--device-kv-gib`).

The arena's page region holds resident pages: device copies of host-pool pages kept while there is room
(`gpu_working_set.resident_pages.ResidentPages` keeps the map and the LRU stamps). Every step offers the requests'
new pages a device page, spilling the coldest whole pages of others under pressure, and brings spilled pages back
while device pages are free. A selected position on a resident page is read from its page; only the others go
through the resolver (window, hot buffer, miss), so a request that spilled nothing reads every row from the
device, as ResidentKV does. A step with fewer than MIN_RESIDENT_SHARE of its pages resident reads every row
through the working set instead (the split costs more than those reads save).

`HybridPages` is the part of `HiSparseKV` that does this (a mixin over the store's state: its arena, page tables,
step tables and device counters).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..gpu_working_set.resolver import KEY_SPAN, NO_KEY

MIN_RESIDENT_SHARE = 1 / 8   # below this share of a step's pages resident, its selections are not split


class HybridPages:
    """Resident pages of a HiSparse store (see the module docstring); `resident` is None without a budget."""

    def place_pages(self, segments: Sequence) -> None:
        """Hybrid: offer every request's new pages a device page (spilling the coldest others' if the device is
        full), bring spilled pages back while device pages are free (copied from the host pool), and send the
        changes to the device. Host work per step is the step's new pages; a request's pages are walked only when
        its table grew or the device map changed."""
        res, P, tables = self.resident, self.page_tokens, self.pages.tables
        res.step = self.step
        res.fit(self.pages.high_water)
        held, n_resident = self.page_counts(segments)
        version = res.version
        if held > n_resident and res.resident + held - n_resident > res.allocated:
            self.grow_pages(res.resident + held - n_resident)
        written = [h for s in segments for h in tables[s.req][s.start // P: -(-(s.start + s.length) // P)]]
        if any(len(tables[s.req]) > self.placed.get(s.req, 0) for s in segments):
            # a step with too few of its pages resident reads none from the device (skip_split): spilling a page
            # for a new one would only move the few resident pages around
            spill, keep = n_resident >= MIN_RESIDENT_SHARE * held, set(written)
            for s in segments:
                pages = tables[s.req]
                res.place(pages[self.placed.get(s.req, 0):], keep, spill)
                self.placed[s.req] = len(pages)
        if res.free and held > n_resident:
            back = [pair for s in segments if res.free for pair in res.readmit(tables[s.req])]
            if back:
                self.copy_back(back)
        res.apply()
        self.stats.spilled_pages = res.spilled_pages
        if res.version != version:
            held, n_resident = self.page_counts(segments)
        # a static step runs the general path whatever is resident (its ops must not depend on the step)
        self.all_resident = not self.static and n_resident == held
        # an eager all-resident decode step reads no window: the window moves wait until a step needs them (it
        # loads them from the host pool first); a prefill leaves them current, for static decode steps
        self.windows_wait = self.all_resident and all(s.length <= 1 for s in segments)
        if self.windows_wait:
            self.stale_windows.update(s.req for s in segments)
        elif not self.all_resident:
            for s in segments:
                if s.req in self.stale_windows:
                    self.load_window(s.req, s.start)
        # whether the step writes rows into resident pages (a static step computes their places whatever they are;
        # an all-resident step reads its rows back from there, even a DCP rank's step that owns none of them)
        self.writes_pages = self.static or self.all_resident or any(h in res.dev_of for h in written)
        # with few resident pages, splitting every selection costs more than their reads save: the step reads
        # every selected row through the working set (exact: the host pool backs every row up)
        self.skip_split = not self.static and n_resident < MIN_RESIDENT_SHARE * held
        # a decode step with every page resident reads every position its rows select: min(k, end) per row
        self.step_visible = sum(min(self.cfg.index_topk, s.start + s.length) for s in segments)

    def page_counts(self, segments: Sequence) -> tuple[int, int]:
        """(pages, resident pages) the step's requests hold; a request's are counted again only when its table
        grew or the device map changed since."""
        res, tables, held, resident = self.resident, self.pages.tables, 0, 0
        for s in segments:
            pages = tables[s.req]
            known = self.page_count.get(s.req)
            if known is None or known[0] != res.version or known[1] != len(pages):
                known = self.page_count[s.req] = (res.version, len(pages), res.count(pages))
            held += known[1]
            resident += known[2]
        return held, resident

    def grow_pages(self, want: int) -> None:
        """Allocate resident pages towards `want` (up to the budget) and grow the arena's page region to match."""
        if self.resident.grow(want):
            self.arena.fit(self.arena.slots, self.arena.step_cap, self.resident.allocated * self.page_tokens)

    def copy_back(self, pages: list[tuple[int, int]]) -> None:
        """Copy the rows of (host page, device page) pairs from the host pool into the page region, every KV
        owner. Only after a spill or a prefix-cache hit, when pages free up: rare, so the wait for the host
        backups is acceptable."""
        P = self.page_tokens
        within = torch.arange(P)
        host = torch.cat([h * P + within for h, _ in pages])
        dev = torch.cat([d * P + within for _, d in pages]).to(self.device)
        self.load_rows(host, self.arena.page_base, dev)

    def split_resident(self, group: int, seg: torch.Tensor, sel: torch.Tensor
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Hybrid: (the selection without its resident positions, which positions are resident, their row in
        the page region) of an index group's selection; the resolver sees only the first, None when every page of
        the step's requests is resident (nothing to resolve). Without resident pages, or with fewer than
        MIN_RESIDENT_SHARE of the step's pages resident (not in a static step): (sel, None, None)."""
        if self.resident is None or self.skip_split:
            return sel, None, None
        cached = self.resident_split.get(group)
        if cached is not None and cached[0] is sel:
            return cached[1:]
        pos = sel.clamp(min=0)
        hit, prow = self.resident.locate(self.page_of(seg, pos), sel, pos, self.page_tokens, self.stamp,
                                         self.all_resident)
        out = (None if self.all_resident else torch.where(hit, -1, sel), hit, prow)
        if cached is None:     # the group's own selection: count its distinct resident positions once
            self.resident_split[group] = (sel, *out)
            decode = sel.shape[0] == self.step_slot.numel()   # one query row per segment: distinct selections
            if self.all_resident and decode:                  # every selected position (known on the host)
                self.stats.resident_hits += len(self.members[group]) * self.step_visible
                return out
            hit = sel >= 0 if hit is None else hit
            if self.static:    # (only a static step has padding segments)
                hit = hit & (self.real[seg] > 0)[:, None]
            n = hit.sum() if decode else self.distinct(seg, sel, hit)
            self.resident_counts.append((len(self.members[group]), n))
        return out

    def count_resident(self) -> None:
        """Add the step's resident hits (every index group's, times its member layers) to the device counter."""
        if self.resident_counts:
            weights = tuple(m for m, _ in self.resident_counts)
            w = self.count_weights.get(weights)
            if w is None:
                w = self.count_weights[weights] = torch.tensor(weights, device=self.device)
            self.kernel_counts[3] += (torch.stack([n for _, n in self.resident_counts]) * w).sum()
            self.resident_counts.clear()

    def on_pages(self, layer: int, hit: torch.Tensor, prow: torch.Tensor, other: torch.Tensor | int) -> torch.Tensor:
        """Arena rows of a selection: its resident positions' rows in `layer`'s source page region, `other`
        elsewhere."""
        return torch.where(hit, self.arena.page_base[self.source(layer)] + prow, other)

    def page_of(self, seg: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The device page (-1: host only) of positions [n, ...] >= 0 of the rows' segments seg [n], one flat
        gather."""
        if self.seg_pages is None:      # [S, max_pages] device page of each segment's pages, once per step
            self.seg_pages = self.resident.slot_of[self.tables.pages]
        if self.seg_base is None or self.seg_base[0] is not seg:     # the layers of a step share their rows
            base = seg * self.seg_pages.shape[1]
            self.seg_base = (seg, base, base[:, None])
        return torch.take(self.seg_pages, self.seg_base[positions.dim()] + positions // self.page_tokens)

    def distinct(self, seg: torch.Tensor, sel: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
        """How many distinct (segment, position) pairs the `hit` entries of sel [n, k] name (a device count): one
        mark per position of the step's contexts, no sort; a static step sorts its keys (a size fixed by the
        step's shape)."""
        if self.static:
            keys, _ = torch.sort(torch.where(hit, seg[:, None] * KEY_SPAN + sel, NO_KEY).flatten())
            return (keys[:1] != NO_KEY).sum() + ((keys[1:] != keys[:-1]) & (keys[1:] != NO_KEY)).sum()
        ends = self.tables.end
        base = torch.cumsum(ends, 0) - ends
        total = self.step_context
        mark = torch.zeros(total + 1, dtype=torch.bool, device=self.device)
        mark[torch.where(hit, base[seg][:, None] + sel, total)] = True
        return mark[:total].sum()

    def resident_rows(self) -> int:
        """Latent rows (token positions x KV owners) held in resident pages now."""
        return 0 if self.resident is None else self.resident.resident * self.page_tokens * len(self.arena.owners)

    def residency(self, req: Hashable) -> float:
        """Fraction of a request's pages that are resident (1.0 when nothing of it spilled)."""
        pages = self.pages.pages_of(req)
        return self.resident_pages_of(req) / pages if pages else 0.0

    def resident_pages_of(self, req: Hashable) -> int:
        """How many of a request's pages are resident."""
        return 0 if self.resident is None else self.resident.count(self.pages.tables.get(req, ()))
