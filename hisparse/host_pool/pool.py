"""The host latent pool: one host buffer (with CUDA: pinned at its exact size, `pinned.py`) of fixed-size pages
holding every latent row.

Physical layout: `[kv_owner_layers, n_pages, page_tokens, row_bytes]` uint8. A page is a block of
`page_tokens` consecutive positions of one request, striped across every KV-owning layer, so one allocation
covers all layers and each layer has a contiguous view `[n_pages * page_tokens, row_bytes]`. KV-consumer
layers own no rows: they are bound to their source layer's view (zero bytes). The page table
(`pages.PageTable`) maps position -> page; the device's indexer-key store uses the same page ids.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from .layout import RowLayout
from .pages import PageTable, PoolExhausted
from .pinned import pinned_empty

GIB = 1 << 30

__all__ = ["GIB", "HostPool", "PoolExhausted"]


class HostPool:
    """kv_sources[l]: the layer whose rows layer l reads (l itself for a KV owner)."""

    def __init__(self, layout: RowLayout, kv_sources: Sequence[int], host_pool_gib: float, page_tokens: int,
                 pin: bool | None = None):
        self.layout, self.page_tokens, self.kv_sources = layout, page_tokens, tuple(kv_sources)
        self.owner_layers = [l for l, src in enumerate(self.kv_sources) if src == l]
        self.slot_of_layer = {l: i for i, l in enumerate(self.owner_layers)}
        self.page_bytes = page_tokens * layout.row_bytes * len(self.owner_layers)
        n_pages = int(host_pool_gib * GIB) // self.page_bytes
        if n_pages < 1:
            raise ValueError(f"host_pool_gib: {host_pool_gib} GiB holds no page of {self.page_bytes} B "
                             f"({page_tokens} tokens x {len(self.owner_layers)} layers x {layout.row_bytes} B)")
        pin = torch.cuda.is_available() if pin is None else pin
        shape = (len(self.owner_layers), n_pages, page_tokens, layout.row_bytes)
        # pinned at its exact size (not through the caching host allocator's power-of-two blocks)
        self.buffer = pinned_empty(shape, self) if pin else torch.empty(shape, dtype=torch.uint8)
        self.pages = PageTable(n_pages, page_tokens)

    # ---- geometry / capacity ----
    @property
    def n_pages(self) -> int:
        return self.pages.n_pages

    @property
    def token_capacity(self) -> int:
        return self.n_pages * self.page_tokens

    @property
    def pages_used(self) -> int:
        return self.pages.pages_used

    @property
    def tables(self) -> dict[Hashable, list[int]]:
        return self.pages.tables

    def usage_ratio(self) -> float:
        return self.pages_used / self.n_pages

    def tokens_free(self) -> int:
        return len(self.pages.free_pages) * self.page_tokens

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def metadata_bytes(self) -> int:
        return 8 * (self.pages_used + len(self.pages.free_pages))

    @property
    def rows(self) -> torch.Tensor:
        """Every stored row of every KV-owning layer, [owner layers * n_pages * page_tokens, row_bytes]."""
        return self.buffer.view(-1, self.layout.row_bytes)

    def layer_offset(self, layer: int) -> int:
        """Where `layer`'s view (`layer_view`) starts in `rows`."""
        return self.slot_of_layer[self.kv_sources[layer]] * self.n_pages * self.page_tokens

    def layer_view(self, layer: int) -> torch.Tensor:
        """[n_pages * page_tokens, row_bytes] rows of `layer`'s source (KV consumers bind to their source)."""
        src = self.kv_sources[layer]
        return self.buffer[self.slot_of_layer[src]].view(-1, self.layout.row_bytes)

    # ---- allocation ----
    def ensure(self, req: Hashable, n_positions: int) -> None:
        """Make positions [0, n_positions) of req addressable; PoolExhausted (nothing changed) if it can't."""
        self.pages.ensure(req, n_positions)

    def free(self, req: Hashable) -> None:
        self.pages.free(req)
