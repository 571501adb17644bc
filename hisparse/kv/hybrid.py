"""Hybrid offload: device memory as a cache of the host pool (`--kv-offload hybrid`, `--device-kv-gib`).

The arena's page region holds resident pages: device copies of host-pool pages kept while there is room
(`gpu_working_set.resident_pages.ResidentPages` keeps the map and the LRU stamps). Every step offers the requests'
new pages a device page, spilling the coldest whole pages of others under pressure, and brings spilled pages back
while device pages are free. The resolver sends each selected position to its resident page, the window, a hot
slot or a miss in one pass (`resolver.PageMap`), so a request that spilled nothing reads every row from the
device, as ResidentKV does; a decode step whose every page is resident reads its rows straight from the pages,
with no resolver at all.

`HybridPages` is the part of `HiSparseKV` that does this (a mixin over the store's state: its arena, page tables,
step tables and device counters).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..gpu_working_set.resolver import PageMap

MIN_SPILL_SHARE = 1 / 8   # below this share of a step's pages resident, new pages do not spill others


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
            # with few of the step's pages resident (a saturated device), a new page takes a free device page only:
            # it sits in its request's window until the window moves on, so spilling a page that selections read
            # from the device for it gains nothing, and would cycle the few device pages through the newest pages
            spill, keep = n_resident >= MIN_SPILL_SHARE * held, set(written)
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
        # an eager all-resident decode step reads its rows straight from the pages and no window: the window
        # moves wait until a step needs them (it loads them from the host pool first); a prefill leaves them
        # current, for static decode steps
        self.resident_decode = self.all_resident and all(s.length <= 1 for s in segments)
        if self.resident_decode:
            self.stale_windows.update(s.req for s in segments)
        elif not self.all_resident:
            for s in segments:
                if s.req in self.stale_windows:
                    self.load_window(s.req, s.start)
        # whether the step writes rows into resident pages (a static step computes their places whatever they are;
        # an all-resident step reads its rows back from there, even a DCP rank's step that owns none of them)
        self.writes_pages = self.static or self.all_resident or any(h in res.dev_of for h in written)
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

    def page_map(self) -> PageMap | None:
        """The step's resident pages as the resolvers see them (None without resident pages)."""
        if self.resident is None:
            return None
        if self.seg_pages is None:      # [S, max_pages] device page of each segment's pages, once per step
            self.seg_pages = self.resident.slot_of[self.tables.pages]
        return PageMap(self.seg_pages, self.page_tokens, self.resident.stamp)

    def rows_on_pages(self, layer: int, seg: torch.Tensor, sel: torch.Tensor, empty: int | None) -> torch.Tensor:
        """A decode step with every page resident (`resident_decode`): the arena rows of sel [n, k] in `layer`'s
        page region, straight from the page map (no resolver), stamping the pages read. `empty`: the row of an
        empty entry (None: its request's position 0, a finite row)."""
        group = self.cfg.layers[layer].index_source
        cached = self.resident_split.get(group)
        if cached is None or cached[0] is not sel:      # members of a group share the selection
            pos = sel.clamp(min=0)
            d = self.page_map().page_of(seg[:, None], pos)
            self.resident.stamp.index_fill_(0, d.flatten(), self.stamp)
            prow = d * self.page_tokens + pos % self.page_tokens
            if cached is None:   # the group's own selection: every selected position is resident (host-known)
                self.resident_split[group] = (sel, prow)
                self.stats.resident_hits += len(self.members[group]) * self.step_visible
        else:
            prow = cached[1]
        idx = self.arena.page_base[self.source(layer)] + prow
        return idx if empty is None else torch.where(sel >= 0, idx, empty)

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
