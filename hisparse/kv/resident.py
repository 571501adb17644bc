"""ResidentKV: the exact reference store, every latent row of every request on the compute device."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..core.config import ModelConfig
from ..core.step_inputs import StepInputs
from ..host_pool.pages import PageTable, paged_rows
from .base import LatentKV, RowSource
from .paged_store import PagedStore


class ResidentKV(LatentKV):
    """Reference: every latent row of every request on the compute device, in one paged store per KV owner."""

    def __init__(self, cfg: ModelConfig, layout: str | None = "fp8_ds_mla", device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, budget_tokens: int | None = None, page_tokens: int = 16,
                 kernels: str = "torch", index_cache: str = "fp32", prefix_caching: bool = False):
        super().__init__(cfg, layout, device, dtype, PageTable(0, page_tokens, growable=True, name="device KV"),
                         kernels, index_cache, prefix_caching)
        self.rows = PagedStore(cfg.kv_owner_layers, self.stored_width, self.stored_dtype, self.device, page_tokens)
        self.budget_tokens = budget_tokens   # device-memory budget in tokens (None: unbounded)

    def token_capacity(self) -> int | None:
        return self.budget_tokens

    def stage(self, segments: Sequence, query_rows: Sequence[int] | None, inputs: StepInputs) -> None:
        self.rows.fit(self.pages.high_water)

    def reserve_device(self, max_seqs: int, max_tokens: int, step_rows: int) -> None:
        super().reserve_device(max_seqs, max_tokens, step_rows)
        self.rows.fit(max_seqs * self.pages_for(max_tokens))

    def device_buffers(self) -> list[torch.Tensor]:
        return super().device_buffers() + list(self.rows.data.values())

    def write(self, layer: int, seg: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        self.rows.write(layer, paged_rows(self.tables.pages, seg, positions, self.page_tokens), self.encode(rows))

    def gather(self, layer: int, seg: torch.Tensor, sel: torch.Tensor) -> RowSource:
        idx = paged_rows(self.tables.pages, seg[:, None].expand_as(sel), sel.clamp(min=0), self.page_tokens)
        store = self.rows.data[self.source(layer)]
        if self.layout:
            return lambda lo, hi: self.layout.gather_unpack(store, idx[lo:hi], self.dtype)
        return lambda lo, hi: torch.index_select(store, 0, idx[lo:hi].flatten()).view(hi - lo, sel.shape[1],
                                                                                      self.rows.width)

    def stored_rows(self, layer: int, seg: torch.Tensor, sel: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        idx = paged_rows(self.tables.pages, seg[:, None].expand_as(sel), sel.clamp(min=0), self.page_tokens)
        return self.rows.data[self.source(layer)], torch.where(sel >= 0, idx, -1), None

    def request_device_bytes(self, n_tokens: int) -> int:
        return super().request_device_bytes(n_tokens) + self.pages_for(n_tokens) * self.rows.bytes_per_page()

    def residency(self, req: Hashable) -> float:
        return 1.0

    def latent_bytes(self, req: Hashable | None = None) -> int:
        """Device bytes of latent rows held (by one request, or by all)."""
        pages = len(self.pages.refs) if req is None else self.pages.pages_of(req)
        return pages * self.rows.bytes_per_page()
