"""The host latent pool: one (pinned, with CUDA) host buffer of fixed-size pages holding every latent row.

Physical layout: `[kv_owner_layers, n_pages, page_tokens, row_bytes]` uint8. A page is a block of
`page_tokens` consecutive positions of one request, striped across every KV-owning layer, so one allocation
covers all layers and each layer has a contiguous view `[n_pages * page_tokens, row_bytes]`. KV-consumer
layers own no rows: they are bound to their source layer's view (zero bytes). Per-request page tables map
position -> page; pages are allocated on write and returned on free.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..model.config import ModelConfig
from .layout import RowLayout

GIB = 1 << 30


class PoolExhausted(RuntimeError):
    """The host pool has no free page for a write; nothing was changed."""


class HostPool:
    def __init__(self, cfg: ModelConfig, layout: RowLayout, host_pool_gib: float, page_tokens: int = 64,
                 pin: bool | None = None):
        self.cfg, self.layout, self.page_tokens = cfg, layout, page_tokens
        self.owner_layers = cfg.kv_owner_layers
        self.slot_of_layer = {l: i for i, l in enumerate(self.owner_layers)}
        self.page_bytes = page_tokens * layout.row_bytes * len(self.owner_layers)
        self.n_pages = int(host_pool_gib * GIB) // self.page_bytes
        if self.n_pages < 1:
            raise ValueError(f"host_pool_gib: {host_pool_gib} GiB holds no page of {self.page_bytes} B "
                             f"({page_tokens} tokens x {len(self.owner_layers)} layers x {layout.row_bytes} B)")
        pin = torch.cuda.is_available() if pin is None else pin
        self.buffer = torch.empty(len(self.owner_layers), self.n_pages, page_tokens, layout.row_bytes,
                                  dtype=torch.uint8, pin_memory=pin)
        self.free_pages = list(range(self.n_pages - 1, -1, -1))   # stack: pop() gives the lowest id first
        self.tables: dict[Hashable, torch.Tensor] = {}            # req -> page ids [n_pages_of_req] (long)

    # ---- geometry / capacity ----
    @property
    def token_capacity(self) -> int:
        return self.n_pages * self.page_tokens

    @property
    def pages_used(self) -> int:
        return self.n_pages - len(self.free_pages)

    def usage_ratio(self) -> float:
        return self.pages_used / self.n_pages

    def tokens_free(self) -> int:
        return len(self.free_pages) * self.page_tokens

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def metadata_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tables.values()) + 8 * len(self.free_pages)

    def layer_view(self, layer: int) -> torch.Tensor:
        """[n_pages * page_tokens, row_bytes] rows of `layer`'s source (KV consumers bind to their source)."""
        src = self.cfg.layers[layer].kv_source
        return self.buffer[self.slot_of_layer[src]].view(-1, self.layout.row_bytes)

    # ---- allocation ----
    def ensure(self, req: Hashable, n_positions: int) -> None:
        """Make positions [0, n_positions) of req addressable; PoolExhausted (nothing changed) if it can't."""
        table = self.tables.get(req)
        have = 0 if table is None else table.numel()
        need = -(-n_positions // self.page_tokens) - have
        if need <= 0:
            return
        if need > len(self.free_pages):
            raise PoolExhausted(f"host pool exhausted: request {req!r} needs {need} more pages of "
                                f"{self.page_tokens} tokens, {len(self.free_pages)} free of {self.n_pages}")
        new = torch.tensor([self.free_pages.pop() for _ in range(need)], dtype=torch.long)
        self.tables[req] = new if table is None else torch.cat((table, new))

    def free(self, req: Hashable) -> None:
        table = self.tables.pop(req, None)
        if table is not None:
            self.free_pages.extend(reversed(table.tolist()))

    def rows_of(self, req: Hashable, positions: torch.Tensor) -> torch.Tensor:
        """Flat row ids (into a layer view) of positions [n] of req."""
        table = self.tables[req]
        positions = positions.to(table.device, non_blocking=True)
        return table[positions // self.page_tokens] * self.page_tokens + positions % self.page_tokens

    # ---- data ----
    def write(self, layer: int, req: Hashable, positions: torch.Tensor, data: torch.Tensor) -> None:
        """Store packed rows data [T, row_bytes] of a KV-owning layer (alloc on write)."""
        self.ensure(req, int(positions.max()) + 1)
        self.layer_view(layer)[self.rows_of(req, positions)] = data.to("cpu")

    def read(self, layer: int, req: Hashable, positions: torch.Tensor) -> torch.Tensor:
        """Packed rows [n, row_bytes] (host) of positions as read by `layer`."""
        return self.layer_view(layer)[self.rows_of(req, positions)]
