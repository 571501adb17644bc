"""Resident pages: device copies of host-pool pages, kept while the device has room (hybrid offload).

The host pool always holds every row (the backup); a host page may also have a device page in the arena's page
region, and then every selected position on it is read from there, as if all rows were resident. New pages get a
device page when one is free or when the coldest resident page can be spilled (least recently selected, by the
step stamp every selection leaves on the device); spilled positions go through the hot-buffer path, and a
spilled page returns (copied back from the host) once device pages are free again. `slot_of` maps host page ->
device page on the device (-1: host only); bookkeeping changes reach it with one host -> device copy per step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

HOST_ONLY = -1


class ResidentPages:
    """Up to `cap` device pages (what the budget leaves beside the working sets, at most `n_pages`); `allocated`
    of them exist (the page region grows on demand, by doubling, up to `cap`; `limit` lowers it). The device map
    covers the host pages handed out so far (`fit`)."""

    def __init__(self, n_pages: int, device: torch.device):
        self.n_pages, self.device, self.allocated, self.cap = n_pages, device, 0, n_pages
        self.free: list[int] = []                                    # stack: the lowest id first
        self.dev_of: dict[int, int] = {}                             # host page -> device page
        self.host_of: dict[int, int] = {}                            # device page -> host page
        self.slot_of = torch.full((0,), HOST_ONLY, dtype=torch.long, device=device)   # grown by `fit`
        self.stamp = torch.zeros(n_pages + 1, dtype=torch.long, device=device)   # last step selected (+ scratch)
        self.pending: dict[int, int] = {}                            # host page -> device page or HOST_ONLY
        self.restamp: dict[int, int] = {}                            # device page -> stamp it starts with
        self.step = 0                                                # the current step (stamps of new pages)
        self.spilled_pages = 0                                       # pages spilled so far (a counter)
        self.readmitted_pages = 0                                    # spilled pages brought back so far
        self.version = 0                                             # changes with every map / unmap

    @property
    def resident(self) -> int:
        return len(self.dev_of)

    def fit(self, host_pages: int) -> None:
        """Room in the device map for host pages 0 .. host_pages - 1 (grows by doubling; between steps)."""
        n = self.slot_of.numel()
        if host_pages > n:
            grow = max(host_pages, 2 * n) - n
            self.slot_of = torch.cat((self.slot_of, self.slot_of.new_full((grow,), HOST_ONLY)))

    def grow(self, want: int) -> bool:
        """Allocate device pages towards `want` in all (at least double, at most the budget); whether the
        count changed (the caller grows the page region to `allocated` pages)."""
        new = min(self.cap, max(want, 2 * self.allocated))
        if new <= self.allocated:
            return False
        self.free = list(range(new - 1, self.allocated - 1, -1)) + self.free
        self.allocated = new
        return True

    def place(self, host_pages: Iterable[int], keep: set[int], spill: bool = True) -> None:
        """Give each new host page of a request a device page: a free one, else (with `spill`) the coldest resident
        page's outside `keep` (the pages this step writes), which spills. Pages that find none stay host-only."""
        for h in host_pages:
            if not self.free and not (spill and self.spill_coldest(keep)):
                return
            self.map(h, self.free.pop())

    def limit(self, cap: int) -> list[tuple[int, int]]:
        """Lower the page count to `cap` (the budget's room for pages now): spill the coldest resident pages the
        lower ids cannot hold, move the others above `cap` to free pages below it (their stamps kept); the
        (from, to) device pages whose rows the caller copies before the page region shrinks. Reads the stamps from
        the device: only when working sets grow (between steps)."""
        self.cap = cap = min(cap, self.n_pages)
        if self.allocated <= cap:
            return []
        stamps = self.stamp[: self.allocated].tolist()
        for _, d in sorted((stamps[d], d) for d in self.host_of)[: max(0, self.resident - cap)]:
            self.unmap(self.host_of[d])
            self.spilled_pages += 1
        low = sorted((d for d in self.free if d < cap), reverse=True)
        moves = [(d, low.pop()) for d in sorted(self.host_of) if d >= cap]
        for d, to in moves:
            h = self.host_of[d]
            self.unmap(h)
            self.map(h, to)
            self.restamp[to] = stamps[d]
        self.free = sorted((d for d in self.free if d < cap and d not in self.host_of), reverse=True)   # lowest last
        self.allocated = cap
        return moves

    def spill_coldest(self, keep: set[int]) -> bool:
        """Spill the least recently selected resident page not in `keep` (ties: the lowest device page). Reads
        the stamps from the device: this happens only when the device is full and a page is wanted."""
        stamps = self.stamp[: self.allocated].tolist()
        candidates = [(stamps[d], d) for d, h in self.host_of.items() if h not in keep]
        if not candidates:
            return False
        d = min(candidates)[1]
        self.unmap(self.host_of[d])
        self.spilled_pages += 1
        return True

    def readmit(self, host_pages: Iterable[int]) -> list[tuple[int, int]]:
        """Bring a request's spilled pages back while device pages are free; the (host, device) pages whose rows the
        caller copies from the host pool."""
        back = []
        for h in host_pages:
            if not self.free:
                break
            if h not in self.dev_of:
                d = self.free.pop()
                self.map(h, d)
                back.append((h, d))
        self.readmitted_pages += len(back)
        return back

    def release(self, host_pages: Iterable[int]) -> None:
        """The pages of a finished request: their device pages are free again."""
        for h in host_pages:
            if h in self.dev_of:
                self.unmap(h)

    def map(self, h: int, d: int) -> None:
        self.version += 1
        self.dev_of[h], self.host_of[d] = d, h
        self.pending[h] = d
        self.restamp[d] = self.step      # a page written or brought back now counts as just used

    def unmap(self, h: int) -> None:
        self.version += 1
        d = self.dev_of.pop(h)
        del self.host_of[d]
        self.free.append(d)
        self.pending[h] = HOST_ONLY

    def apply(self) -> None:
        """Send the step's bookkeeping changes to the device (one copy; nothing when nothing changed)."""
        if not self.pending:
            return
        n = len(self.pending)
        upd = torch.tensor(list(self.pending.items()) + list(self.restamp.items()), dtype=torch.long)
        upd = upd.to(self.device)
        self.slot_of[upd[:n, 0]] = upd[:n, 1]
        self.stamp[upd[n:, 0]] = upd[n:, 1]
        self.pending.clear()
        self.restamp.clear()

    def count(self, host_pages: Iterable[int]) -> int:
        """How many of these host pages (one request's) are resident."""
        return sum(h in self.dev_of for h in host_pages)
