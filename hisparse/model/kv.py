"""The LatentKV seam: attention writes and reads latent rows only through this interface.

`ResidentKV` keeps every row on the compute device (the reference). HiSparse (`hisparse.gpu_working_set`)
implements the same interface over the host pool and must return bit-identical rows. Both store rows in
the same byte layout (`fp8_ds_mla`, `bf16`) or, with layout None, unquantised in the compute dtype (exact
reference mode for tests). KV-consumer layers read their source layer's rows. The indexer key cache always
stays on the compute device (`IndexKeyCache`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, fields

import torch

from ..host_pool.layout import RowLayout
from .config import ModelConfig


class DeviceRows:
    """Growable per-(layer, request) row buffers on one device; positions index rows directly."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device):
        self.width, self.dtype, self.device = width, dtype, torch.device(device)
        self.buffers: dict[tuple[int, Hashable], torch.Tensor] = {}

    def write(self, layer: int, req: Hashable, positions: torch.Tensor, values: torch.Tensor) -> None:
        need = int(positions.max()) + 1
        buf = self.buffers.get((layer, req))
        if buf is None or buf.shape[0] < need:
            cap = max(need, 2 * (buf.shape[0] if buf is not None else 0), 16)
            new = torch.zeros(cap, self.width, dtype=self.dtype, device=self.device)
            if buf is not None:
                new[: buf.shape[0]] = buf
            buf = self.buffers[(layer, req)] = new
        buf[positions] = values.to(self.dtype)

    def read(self, layer: int, req: Hashable, positions: torch.Tensor) -> torch.Tensor:
        return self.buffers[(layer, req)][positions]

    def prefix(self, layer: int, req: Hashable, n: int) -> torch.Tensor:
        return self.buffers[(layer, req)][:n]

    def release(self, req: Hashable) -> None:
        for key in [k for k in self.buffers if k[1] == req]:
            del self.buffers[key]

    def nbytes(self, req: Hashable | None = None) -> int:
        return sum(b.numel() * b.element_size() for k, b in self.buffers.items() if req is None or k[1] == req)


class IndexKeyCache(DeviceRows):
    """Indexer keys K [S, dI] per (indexer-owner layer, request), resident on the compute device."""


@dataclass
class KVStats:
    """Cumulative HiSparse counters (all zero for ResidentKV); the server exports them as hisparse_* metrics."""
    hits: int = 0                 # selected rows already on the device (resident window or hot buffer)
    misses: int = 0               # selected rows copied host -> device
    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    overlapped_copies: int = 0    # miss copies issued ahead of the layer that needed them (prefetch)
    steps: int = 0

    def snapshot(self) -> "KVStats":
        return KVStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def summary(self) -> str:
        sel = self.hits + self.misses
        rate = self.hits / sel if sel else 0.0
        return (f"hits={self.hits} misses={self.misses} hit_rate={rate:.3f} h2d={self.host_to_device_bytes}B "
                f"d2h={self.device_to_host_bytes}B overlapped={self.overlapped_copies} steps={self.steps}")


class LatentKV(ABC):
    """Where latent rows (c || k_rope, width r + dR) live. Positions are absolute token positions."""

    dcp = None   # hisparse.dcp.context.DCPContext when this store holds one rank's shard (hisparse.dcp.kv.ShardedKV)

    def __init__(self, cfg: ModelConfig, layout: str | None, device: torch.device | str, dtype: torch.dtype):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.layout = RowLayout.for_config(cfg, layout) if layout else None
        self.index_cache = IndexKeyCache(cfg.index_head_dim, dtype, self.device)
        self.stats = KVStats()
        self.reserved: dict[Hashable, int] = {}   # admission reservations, in tokens (page-rounded)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, r + dR] -> the stored form (layout bytes, or the compute dtype when layout is None)."""
        return self.layout.pack(rows) if self.layout else rows.to(self.dtype)

    def decode(self, data: torch.Tensor) -> torch.Tensor:
        return self.layout.unpack(data, self.dtype) if self.layout else data

    @property
    def stored_width(self) -> int:
        return self.layout.row_bytes if self.layout else self.cfg.latent_dim

    @property
    def stored_dtype(self) -> torch.dtype:
        return torch.uint8 if self.layout else self.dtype

    def source(self, layer: int) -> int:
        """The layer whose rows `layer` reads (itself for a KV owner)."""
        return self.cfg.layers[layer].kv_source

    @abstractmethod
    def write(self, layer: int, req: Hashable, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows [T, r + dR] of a KV-owning layer at `positions` [T]."""

    @abstractmethod
    def gather(self, layer: int, req: Hashable, positions: torch.Tensor) -> torch.Tensor:
        """Rows [n, r + dR] (compute device and dtype) for `positions` [n] as read by `layer`."""

    def begin_step(self, segments: list) -> None:
        """Called once before each model forward with its segments (HiSparse allocates their pages here, so
        running out of pool fails before any row is written)."""

    def end_step(self) -> None:
        """Called once after each model forward (HiSparse flushes eager backups here)."""

    def release(self, req: Hashable) -> None:
        """Free every row, key and slot the request holds."""
        self.index_cache.release(req)
        self.reserved.pop(req, None)

    def truncate(self, req: Hashable, length: int) -> None:
        """Forget positions >= length (speculative rollback): no later gather may see their old rows.

        Positions past a request's length are never selected (selection is causal) and are overwritten by the
        next write, so resident storage needs nothing; HiSparse drops their hot-buffer slots."""

    # ---- capacity and admission: a request reserves its whole length (prompt + max new tokens) up front ----
    page_tokens: int = 1

    def token_capacity(self) -> int | None:
        """Tokens the latent store can hold in all (None: unbounded)."""
        return None

    def _rounded(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_tokens) * self.page_tokens

    def tokens_unreserved(self) -> int | None:
        """Tokens still free for new reservations (None: unbounded)."""
        cap = self.token_capacity()
        return None if cap is None else cap - sum(self.reserved.values())

    def can_ever_admit(self, n_tokens: int) -> bool:
        cap = self.token_capacity()
        return cap is None or self._rounded(n_tokens) <= cap

    def reserve(self, req: Hashable, n_tokens: int) -> bool:
        """Reserve room for n_tokens positions of req; False (nothing changed) if it does not fit now."""
        free = self.tokens_unreserved()
        need = self._rounded(n_tokens) - self.reserved.get(req, 0)
        if free is not None and need > free:
            return False
        self.reserved[req] = self.reserved.get(req, 0) + need
        return True

    def usage_ratio(self) -> float:
        """Fraction of the latent store's capacity reserved (0.0 when unbounded)."""
        cap = self.token_capacity()
        return sum(self.reserved.values()) / cap if cap else 0.0


class ResidentKV(LatentKV):
    """Reference: every latent row of every request on the compute device."""

    def __init__(self, cfg: ModelConfig, layout: str | None = "fp8_ds_mla", device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, budget_tokens: int | None = None):
        super().__init__(cfg, layout, device, dtype)
        self.rows = DeviceRows(self.stored_width, self.stored_dtype, self.device)
        self.budget_tokens = budget_tokens   # device-memory budget in tokens (None: unbounded)

    def token_capacity(self) -> int | None:
        return self.budget_tokens

    def write(self, layer: int, req: Hashable, positions: torch.Tensor, rows: torch.Tensor) -> None:
        self.rows.write(layer, req, positions, self.encode(rows))

    def gather(self, layer: int, req: Hashable, positions: torch.Tensor) -> torch.Tensor:
        return self.decode(self.rows.read(self.source(layer), req, positions))

    def release(self, req: Hashable) -> None:
        super().release(req)
        self.rows.release(req)
