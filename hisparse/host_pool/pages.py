"""Page allocation shared by every paged store: fixed-size pages of `page_tokens` consecutive positions.

A request's page list maps position p to row `pages[p // P] * P + p % P` of any store laid out in pages (the
host pool's latent rows, the device's indexer keys, ResidentKV's device rows), so one table per request serves
them all. Allocation is host bookkeeping done once per step (`ensure` before a forward writes), never per layer.

With a prefix cache (`prefix_cache.PrefixCache`) pages are shared: each page counts the requests holding it, a
request may start from cached pages (`share`), and a cached page its last holder frees is parked in the cache
instead of freed; an allocation with no free page evicts the least recently used parked page.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from .prefix_cache import PrefixCache


class PoolExhausted(RuntimeError):
    """No free page for a write; nothing was changed."""


class PageTable:
    """Page ids per request over `n_pages` pages (`growable`: the page count doubles instead of failing)."""

    def __init__(self, n_pages: int, page_tokens: int, growable: bool = False, name: str = "host pool",
                 cache: PrefixCache | None = None):
        if page_tokens < 1:
            raise ValueError(f"page_tokens: must be >= 1, got {page_tokens}")
        self.n_pages, self.page_tokens, self.growable, self.name = n_pages, page_tokens, growable, name
        self.free_pages = list(range(n_pages - 1, -1, -1))   # stack: pop() gives the lowest id first
        self.tables: dict[Hashable, list[int]] = {}
        self.page_ids: dict[Hashable, torch.Tensor] = {}   # the same lists as tensors, for per-step tables
        self.high_water = 0   # 1 + the highest page id ever handed out: what a store laid out in pages must hold
        self.refs: dict[int, int] = {}   # page -> how many requests hold it (absent: none)
        self.cache = cache

    @property
    def parked_pages(self) -> int:
        """Cached pages no request holds (freed on demand)."""
        return len(self.cache.parked) if self.cache is not None else 0

    def evict_keys(self, keys: Sequence[bytes]) -> None:
        """Free the parked cached pages of these keys."""
        for key in keys:
            self.free_pages.append(self.cache.evict_key(key))

    def evict(self, n: int) -> None:
        """Free up to n parked cached pages, least recently used first."""
        for _ in range(min(n, self.parked_pages)):
            self.free_pages.append(self.cache.evict())

    @property
    def pages_used(self) -> int:
        return self.n_pages - len(self.free_pages)

    def pages_needed(self, req: Hashable, n_positions: int) -> int:
        return -(-n_positions // self.page_tokens) - len(self.tables.get(req, ()))

    def ensure(self, req: Hashable, n_positions: int) -> None:
        """Make positions [0, n_positions) of req addressable; PoolExhausted (nothing changed) if it can't."""
        need = self.pages_needed(req, n_positions)
        if need <= 0:
            return
        self.evict(need - len(self.free_pages))
        if need > len(self.free_pages) and self.growable:
            grow = max(self.n_pages, need - len(self.free_pages))
            self.free_pages = list(range(self.n_pages + grow - 1, self.n_pages - 1, -1)) + self.free_pages
            self.n_pages += grow
        if need > len(self.free_pages):
            raise PoolExhausted(f"{self.name} exhausted: request {req!r} needs {need} more pages of "
                                f"{self.page_tokens} tokens, {len(self.free_pages)} free of {self.n_pages}")
        new = [self.free_pages.pop() for _ in range(need)]
        self.refs.update((p, 1) for p in new)
        self.tables.setdefault(req, []).extend(new)
        self.page_ids[req] = torch.tensor(self.tables[req], dtype=torch.long)
        self.high_water = max(self.high_water, max(new) + 1)

    def share(self, req: Hashable, pages: list[int]) -> None:
        """Start the table of req (which holds no page) with cached pages."""
        for p in pages:
            self.refs[p] = self.refs.get(p, 0) + 1
            self.cache.unpark(p)
        self.tables[req] = list(pages)
        self.page_ids[req] = torch.tensor(pages, dtype=torch.long)

    def held_only_by(self, req: Hashable) -> list[int]:
        """The pages of req no other request holds."""
        return [p for p in self.tables.get(req, ()) if self.refs[p] == 1]

    def free(self, req: Hashable) -> None:
        """Let go of req's pages: a page nobody holds any more is parked if cached, else freed."""
        pages = self.tables.pop(req, None)
        self.page_ids.pop(req, None)
        for p in reversed(pages or ()):
            if self.refs[p] > 1:
                self.refs[p] -= 1
                continue
            del self.refs[p]
            if self.cache is not None and self.cache.holds(p):
                self.cache.park(p)
            else:
                self.free_pages.append(p)

    def pages_of(self, req: Hashable) -> int:
        return len(self.tables.get(req, ()))

    def table(self, reqs: Sequence[Hashable], width: int | None = None) -> torch.Tensor:
        """Page ids [len(reqs), width] on the host (width None: the most pages a request holds; long; rows padded
        with page 0, never read past a request's length)."""
        empty = torch.zeros(1, dtype=torch.long)
        rows = [self.page_ids.get(r, empty) for r in reqs] or [empty]
        table = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)[: len(reqs)]
        if width is not None:
            table = torch.nn.functional.pad(table, (0, width - table.shape[1]))
        return table


def paged_rows(table: torch.Tensor, seg: torch.Tensor, positions: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """Flat store rows of `positions` (any shape) of segments `seg` (same shape) under the page `table`."""
    return table[seg, positions // page_tokens] * page_tokens + positions % page_tokens


def span_rows(pages: Sequence[int], start: int, end: int, page_tokens: int) -> list[int]:
    """Flat store rows of positions start .. end - 1 of one request with page list `pages` (host ints: the few
    rows a step writes)."""
    return [pages[p // page_tokens] * page_tokens + p % page_tokens for p in range(start, end)]
