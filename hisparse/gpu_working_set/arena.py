"""The device arena: one tensor [rows, row_bytes] holding every request's working set, so that any selected row
of any request is one index into one tensor (a single gather per layer).

Regions, each addressed through the request's slot r (a per-request slot table in the style of vLLM's block
table):
  page[owner]    [page_rows]        resident pages (hybrid offload: `resident_pages.ResidentPages`)
  hot[layer]     [R, n_slots]       the layer's hot buffer (LRU metadata per index group: `resolver.HotSlots`)
  window[owner]  [R, W + sinks]     newest W positions (ring, p % W) then the first `sinks` positions
  step[owner]    [step_cap]         the rows this step writes (row i of the step's write = step row i)
  zero, scratch  one row each       zero: what an empty selection reads; scratch: where writes with nowhere to go land
"""

from __future__ import annotations

import torch


class DeviceArena:
    def __init__(self, source: dict[int, int], n_slots: int, window: int, sinks: int, row_bytes: int,
                 device: torch.device):
        """source: every attending layer -> the KV-owning layer whose rows it reads."""
        self.source, self.page_rows = dict(source), 0
        self.layers, self.owners = list(source), sorted(set(source.values()))
        self.n_slots, self.window, self.sinks, self.row_bytes = n_slots, window, sinks, row_bytes
        self.device = device
        self.slots, self.step_cap = 0, 0
        self._layout()
        self.data = torch.zeros(self.n_rows, row_bytes, dtype=torch.uint8, device=device)

    @property
    def win_rows(self) -> int:
        return self.window + self.sinks

    def _layout(self) -> None:
        """Region bases for the current (slots, step_cap)."""
        R, off = self.slots, 0
        self.page_base, self.hot_base, self.win_base, self.step_base = {}, {}, {}, {}
        for l in self.owners:
            self.page_base[l], off = off, off + self.page_rows
        for l in self.layers:
            self.hot_base[l], off = off, off + R * self.n_slots
        for l in self.owners:
            self.win_base[l], off = off, off + R * self.win_rows
        for l in self.owners:
            self.step_base[l], off = off, off + self.step_cap
        self.zero_row, self.scratch_row = off, off + 1
        self.n_rows = off + 2
        # per layer, the base added to a resolved entry's local row, by kind (STEP, WINDOW, HOT, EXTRA, NONE, PAGE:
        # transient misses and empty selections read the zero row; transient ones are patched in afterwards)
        self.kind_base = {l: torch.tensor([self.step_base.get(src, 0), self.win_base.get(src, 0), self.hot_base[l],
                                           self.zero_row, self.zero_row, self.page_base.get(src, 0)],
                                          dtype=torch.long, device=self.device)
                          for l, src in self.source.items()}
        self.owner_step_base = torch.tensor([[self.step_base[o]] for o in self.owners], dtype=torch.long,
                                            device=self.device)                              # [O, 1]
        self.owner_win_base = torch.tensor([[self.win_base[o]] for o in self.owners], dtype=torch.long,
                                           device=self.device)                               # [O, 1]
        self.owner_page_base = torch.tensor([[self.page_base[o]] for o in self.owners], dtype=torch.long,
                                            device=self.device)                              # [O, 1]

    def regions(self) -> list[tuple[int, int, int]]:
        """(base, rows per slot, slots) of every per-request region, for re-layout."""
        return ([(self.page_base[l], self.page_rows, 1) for l in self.owners]
                + [(self.hot_base[l], self.n_slots, self.slots) for l in self.layers]
                + [(self.win_base[l], self.win_rows, self.slots) for l in self.owners])

    def fit(self, slots: int, step_rows: int, page_rows: int | None = None, exact: bool = False) -> None:
        """Room for `slots` request slots and `step_rows` new rows per step (grown by doubling, or to `slots`
        exactly when `exact`: a budgeted store, whose pages get what slots leave), and `page_rows` resident-page
        rows per KV owner (exactly: the page region grows and shrinks; None keeps it); contents kept (a shrunk page
        region keeps its first rows). Called between steps only: the layer loop never reallocates."""
        page_rows = self.page_rows if page_rows is None else page_rows
        if slots <= self.slots and step_rows <= self.step_cap and page_rows == self.page_rows:
            return
        old, old_regions = self.data, self.regions()
        if slots > self.slots:
            self.slots = slots if exact else max(slots, 2 * self.slots)
        self.step_cap = max(self.step_cap, step_rows, 2 * self.step_cap if step_rows > self.step_cap else 0)
        self.page_rows = page_rows
        self._layout()
        self.data = torch.zeros(self.n_rows, self.row_bytes, dtype=torch.uint8, device=self.device)
        for (ob, per, n), (nb, new_per, new_n) in zip(old_regions, self.regions()):
            k = min(per * n, new_per * new_n)
            self.data[nb: nb + k] = old[ob: ob + k]

    def move_pages(self, moves: list[tuple[int, int]], page_tokens: int) -> None:
        """Copy the rows of device pages `moves` (from, to) within every KV owner's page region (before the
        region shrinks below `from`)."""
        if not moves:
            return
        within = torch.arange(page_tokens)
        src = torch.cat([f * page_tokens + within for f, _ in moves])
        dst = torch.cat([t * page_tokens + within for _, t in moves])
        base = torch.tensor([self.page_base[o] for o in self.owners])[:, None]
        src, dst = (base + src).flatten().to(self.device), (base + dst).flatten().to(self.device)
        self.data.index_copy_(0, dst, torch.index_select(self.data, 0, src))

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows [*idx.shape, row_bytes] at arena rows idx."""
        return torch.index_select(self.data, 0, idx.flatten()).view(*idx.shape, self.row_bytes)

    def window_index(self, slot: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Row within the window regions' per-slot layout (add win_base[owner]) of resident positions."""
        ring = positions % self.window if self.window else torch.zeros_like(positions)
        local = torch.where(positions < self.sinks, self.window + positions, ring)
        return slot * self.win_rows + local

    def page_bytes(self) -> int:
        """Device bytes of the resident-page regions (every KV owner)."""
        return len(self.owners) * self.page_rows * self.row_bytes

    def slot_bytes(self) -> int:
        """Device bytes one request slot holds (hot buffers of every layer + windows of every KV owner)."""
        return (len(self.layers) * self.n_slots + len(self.owners) * self.win_rows) * self.row_bytes
