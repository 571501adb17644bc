"""The device memory of a HiSparse store: one budget (`--device-kv-gib`) for its latent rows on the device.

The budget covers every request slot's working set (resident window + hot slots of every layer, and their LRU
metadata) and, under hybrid offload, the resident pages in what the slots leave. A request needs a working set to
run, so admission counts working sets (`reserve`: a request waits while one more does not fit); resident pages
are a cache above that and never the reason a request waits. The slot regions grow to the slots in use exactly
(each slot taken from the page region, whose coldest pages spill first), so a lone request keeps the rest of the
budget for its pages. Outside the budget: the step region (this step's new rows, sized by the batch's tokens, as
activations are), the indexer keys (every position's, on the device whatever the offload) and the per-page device
map.

`DeviceBudget` is the part of `HiSparseKV` that does this (a mixin over the store's arena, hot metadata and
resident pages).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch


class DeviceBudget:
    """Working sets and resident pages within `budget` bytes (None: unbounded, no resident pages)."""

    budget: int | None

    def working_set_bytes(self) -> int:
        """Device bytes one request's working set holds whatever its length: its arena slot and LRU metadata."""
        return self.arena.slot_bytes() + self.slot_metadata_bytes()

    def slot_metadata_bytes(self) -> int:
        """Device bytes of one request slot's LRU metadata (positions and stamps of its hot slots, every group)."""
        return sum(h.nbytes_per_slot() for h in self.hot.values())

    def max_working_sets(self) -> int | None:
        """How many requests' working sets the budget holds (None: unbounded)."""
        return None if self.budget is None else self.budget // self.working_set_bytes()

    def budget_gib(self, slots: int, pages: int) -> float:
        """The device_kv_gib that holds exactly `slots` working sets of this store's geometry and `pages` resident
        pages beside them."""
        return (slots * self.working_set_bytes() + pages * self.page_bytes) / (1 << 30)

    def page_room(self, slots: int) -> int:
        """Resident pages the budget holds beside `slots` working sets."""
        return max(0, self.budget - slots * self.working_set_bytes()) // self.page_bytes

    def check_budget(self) -> None:
        """The budget holds one request's working set at least (else a ValueError naming the flag)."""
        if self.budget is not None and self.budget < self.working_set_bytes():
            raise ValueError(f"device_kv_gib: {self.budget / 2**30:.6g} GiB is less than one request's working set "
                             f"({self.working_set_bytes():,} bytes: resident window + hot slots of every layer); "
                             "raise it or lower hot_buffer_tokens / resident_window")

    def reserve(self, req: Hashable, n_tokens: int) -> bool:
        """`LatentKV.reserve`, and a request new to the store also needs room for its working set."""
        if self.budget is not None and req not in self.reserved and len(self.reserved) >= self.max_working_sets():
            return False
        return super().reserve(req, n_tokens)

    def fit_slots(self, slots: int, step_rows: int) -> None:
        """Room for `slots` request slots and `step_rows` new rows per step in the arena and the slot metadata; new
        slots of a budgeted store take their room from the resident pages (the coldest spill, the others move
        below the new page count, in the same re-layout)."""
        a, page_rows = self.arena, None
        if self.resident is not None and slots > a.slots:
            a.move_pages(self.resident.limit(self.page_room(slots)), self.page_tokens)
            page_rows = self.resident.allocated * self.page_tokens
        a.fit(slots, step_rows, page_rows, exact=self.budget is not None)
        for h in self.hot.values():
            h.fit(a.slots)
        if self.win_len.numel() < a.slots:
            grow = a.slots - self.win_len.numel()
            self.win_lo = torch.cat((self.win_lo, self.win_lo.new_zeros(grow)))
            self.win_len = torch.cat((self.win_len, self.win_len.new_zeros(grow)))

    def reserve_device(self, max_seqs: int, max_tokens: int, step_rows: int) -> None:
        """`LatentKV.reserve_device`: slots for max_seqs requests (which the budget must hold) and the device map of
        their pages; resident pages are allocated as they are used, within what the slots leave."""
        cap = self.max_working_sets()
        if cap is not None and max_seqs > cap:
            raise ValueError(f"device_kv_gib: {self.budget / 2**30:.6g} GiB holds {cap} working sets of "
                             f"{self.working_set_bytes():,} bytes, fewer than max_num_seqs = {max_seqs}; raise it or "
                             "lower max_num_seqs")
        super().reserve_device(max_seqs, max_tokens, step_rows)
        self.fit_slots(max_seqs, step_rows)
        if self.resident is not None:
            self.resident.fit(max_seqs * self.pages_for(max_tokens))

    def device_nbytes(self) -> int:
        # resident pages count at the room the slots leave them: the page region grows on demand up to it
        room = 0 if self.resident is None else self.resident.cap * self.page_bytes - self.arena.page_bytes()
        return super().device_nbytes() + room

    def device_bytes(self, req: Hashable) -> dict[str, int]:
        """Device memory one request holds, by part (latent = window + hot slots; the rest is metadata)."""
        held = req in self.slot_of
        resident = self.resident_pages_of(req) * self.page_bytes
        return {"latent": self.arena.slot_bytes() if held else 0, "resident_pages": resident,
                "hot_metadata": self.slot_metadata_bytes() if held else 0,
                "index_keys": self.index_cache_bytes(req)}
