"""A paged device store: one tensor per layer whose rows follow the pages of a `PageTable`."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PagedStore:
    """One device tensor [rows, width] per layer, laid out in the pages of a `PageTable` (row = page * P + p % P),
    shared by every request. Grows by doubling when the page table hands out higher page ids (between steps)."""

    def __init__(self, layers: Sequence[int], width: int, dtype: torch.dtype, device: torch.device,
                 page_tokens: int):
        self.width, self.dtype, self.device, self.page_tokens = width, dtype, device, page_tokens
        self.data = {l: torch.zeros(0, width, dtype=dtype, device=device) for l in layers}

    def fit(self, n_pages: int) -> None:
        """Hold page ids < n_pages (keeps every stored row)."""
        need = n_pages * self.page_tokens
        for layer, t in self.data.items():
            if t.shape[0] < need:
                new = torch.zeros(max(need, 2 * t.shape[0]), self.width, dtype=self.dtype, device=self.device)
                new[: t.shape[0]] = t
                self.data[layer] = new

    def write(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.data[layer].index_copy_(0, rows, values.to(self.dtype))

    def bytes_per_page(self) -> int:
        return self.page_tokens * self.width * self.dtype.itemsize * len(self.data)
