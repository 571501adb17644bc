"""The LatentKV seam: attention writes and reads latent rows and indexer keys only through this interface.

Every operation takes the whole batch of one layer: `write` / `write_keys` store the new rows of every request,
`select` picks every query row's top-k, `gather` returns every query row's selected rows, `attend` runs sparse
MLA over them. Rows are described by flat tensors (the segment of each row, its position), never by a loop
over requests. Per-request addressing comes from `StepTables`, built once per forward by `begin_step`.

`ResidentKV` keeps every row on the compute device (the reference). HiSparse (`hisparse.gpu_working_set`)
implements the same interface over the host pool and must return bit-identical rows. Both store rows in
the same byte layout (`fp8_ds_mla`, `bf16`) or, with layout None, unquantised in the compute dtype (exact
reference mode for tests). KV-consumer layers read their source layer's rows. Indexer keys always stay on the
compute device, in one paged store per indexer layer (`IndexKeyStore`: 132-B fp8 records or exact keys)
addressed by the KV store's page table; every store scores them the same way, so HiSparse on/off select alike.

Prefix caching (`prefix_caching`): full pages stay cached after their request ends (their latent rows wherever
the store keeps them, and their indexer keys under the same page id), keyed by the chain of their tokens
(`host_pool.prefix_cache`). `admit` starts a new request from its longest cached page-aligned prefix and
`commit_prefix` caches a request's pages as they fill; cached pages are evicted only for room (`reserve`,
`PageTable.ensure`), never from a running request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, fields

import torch

from ..host_pool.pages import PageTable, paged_rows
from ..host_pool.prefix_cache import PrefixCache, page_keys, salt_of
from ..core.config import ModelConfig
from ..core.step_inputs import StepInputs
from .geometry import row_layout
from .index_cache import IndexKeyStore
from .scoring import Scorer, paged_topk

ATTEND_BLOCK_ELEMS = 1 << 24   # bound on the [rows, k, r + dR] decoded rows sparse MLA holds at once

RowSource = Callable[[int, int], torch.Tensor]   # (lo, hi) -> decoded rows [hi - lo, k, r + dR] of query rows lo..hi


@dataclass
class StepTables:
    """Per-forward addressing on the compute device (segment s = the step's s-th segment, one per request)."""
    reqs: list[Hashable]
    start: torch.Tensor          # [S] first position written this step
    end: torch.Tensor            # [S] start + length: the context each segment's rows can see
    pages: torch.Tensor          # [S, max_pages] page ids of the KV store's page table
    max_end: int                 # bound on every end (host int: the width of padded key scans)


@dataclass
class KVStats:
    """Cumulative HiSparse counters (all zero for ResidentKV); the server exports them as hisparse_* metrics."""
    hits: int = 0                 # selected rows already on the device (resident window or hot buffer)
    misses: int = 0               # selected rows copied host -> device
    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    overlapped_copies: int = 0    # miss copies issued ahead of the layer that needed them (prefetch)
    steps: int = 0
    resident_hits: int = 0        # selected rows read from resident device pages (hybrid offload)
    spilled_pages: int = 0        # resident pages spilled to make room (hybrid offload)
    prefix_queries: int = 0       # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0          # of those, tokens found cached (their prefill skipped)

    def snapshot(self) -> "KVStats":
        return KVStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def summary(self) -> str:
        sel = self.resident_hits + self.hits + self.misses
        rate = (self.resident_hits + self.hits) / sel if sel else 0.0
        return (f"resident_hits={self.resident_hits} hits={self.hits} misses={self.misses} hit_rate={rate:.3f} "
                f"h2d={self.host_to_device_bytes}B d2h={self.device_to_host_bytes}B "
                f"overlapped={self.overlapped_copies} spilled_pages={self.spilled_pages} steps={self.steps} "
                f"prefix_hits={self.prefix_hits}/{self.prefix_queries}")


def sparse_mla(q_lat: torch.Tensor, q_rope: torch.Tensor | None, rows: torch.Tensor, valid: torch.Tensor,
               scale: float, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MQA over each query's own selected rows.

    q_lat [T, H, r] (= W_UK^T qN), q_rope [T, H, dR] or None (NoPE), rows [T, k, r + dR], valid [T, k].
    Returns olat [T, H, r] = sum_s P c[s] and lse [T, H] (-inf where a query has no valid row: output 0).
    """
    c = rows[..., :rank]
    logits = torch.einsum("thc,tkc->thk", q_lat, c)
    if q_rope is not None:
        logits = logits + torch.einsum("thr,tkr->thk", q_rope, rows[..., rank:])
    logits = (logits * scale).masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)                                      # [T, H]
    probs = torch.exp(logits - lse.nan_to_num(neginf=0.0)[..., None])          # empty rows -> all zeros
    return torch.einsum("thk,tkc->thc", probs, c), lse


class LatentKV(ABC):
    """Where latent rows (c || k_rope, width r + dR) and indexer keys live. Positions are absolute positions."""

    def __init__(self, cfg: ModelConfig, layout: str | None, device: torch.device | str, dtype: torch.dtype,
                 pages: PageTable, kernels: str = "torch", index_cache: str = "fp32", prefix_caching: bool = False):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.layout = row_layout(cfg, layout) if layout else None
        # 'triton': `select` scores with the Triton indexer kernel and `attend` runs the Triton sparse MLA kernel
        # over the stored bytes (`stored_rows`); 'torch': torch ops (KVSettings.kernel_path chooses)
        self.kernels = kernels if self.layout else "torch"
        self.pages, self.page_tokens = pages, pages.page_tokens
        # indexer keys: 'fp8' 132-B records (spec §4) or 'fp32' exact keys in the compute dtype (index_cache.py)
        self.index_keys = IndexKeyStore(cfg.index_owner_layers, cfg.index_head_dim, index_cache, dtype,
                                        self.device, pages.page_tokens)
        self.tables: StepTables | None = None
        self.stats = KVStats()
        self.reserved: dict[Hashable, int] = {}   # admission reservations, in tokens (page-rounded)
        if prefix_caching:
            pages.cache = PrefixCache()
        # the root of every key chain: what besides the tokens decides the stored rows and keys
        self.salt = salt_of(cfg, layout, str(dtype), index_cache, pages.page_tokens)
        self.chains: dict[Hashable, list[bytes]] = {}   # request -> keys of its full pages known so far
        self.committed: dict[Hashable, int] = {}        # request -> its pages cached (or matched) so far

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, r + dR] -> the stored form (layout bytes, or the compute dtype when layout is None)."""
        return self.layout.pack(rows) if self.layout else rows.to(self.dtype)

    @property
    def stored_width(self) -> int:
        return self.layout.row_bytes if self.layout else self.cfg.latent_dim

    @property
    def stored_dtype(self) -> torch.dtype:
        return torch.uint8 if self.layout else self.dtype

    def source(self, layer: int) -> int:
        """The layer whose rows `layer` reads (itself for a KV owner)."""
        return self.cfg.layers[layer].kv_source

    # ---- step lifecycle ----
    def begin_step(self, segments: Sequence, query_rows: Sequence[int] | None = None,
                   inputs: StepInputs | None = None, span: int | None = None) -> dict[str, torch.Tensor]:
        """Called once before each forward with its segments (one per request): allocates their pages (so running
        out fails before any row is written) and sends the step's tables to the device in one copy. query_rows:
        the query rows of each segment when they differ from the rows it stores (a DCP shard stores only its own
        positions). inputs: the copy to add the tables to (the caller may have staged its own parts; a static
        one keeps every table at the same device address for a step of the same shape); span: the positions every
        segment's page table covers (None: the step's longest context), so tables and key scans have a shape
        that does not depend on the step. Returns the copy's device views."""
        for seg in segments:
            self.pages.ensure(seg.req, seg.start + seg.length)
        self.index_keys.fit(self.pages.high_water)
        inputs = inputs if inputs is not None else StepInputs(self.device)
        reqs = [s.req for s in segments]
        max_end = span if span is not None else max((s.start + s.length for s in segments), default=0)
        inputs.stage("start", torch.tensor([s.start for s in segments], dtype=torch.long))
        inputs.stage("end", torch.tensor([s.start + s.length for s in segments], dtype=torch.long))
        inputs.stage("pages", self.pages.table(reqs, None if span is None else self.pages_for(span)))
        self.stage(segments, query_rows, inputs)
        views = inputs.commit()
        self.tables = StepTables(reqs, views["start"], views["end"], views["pages"], max_end)
        self.bind(views)
        return views

    def stage(self, segments: Sequence, query_rows: Sequence[int] | None, inputs: StepInputs) -> None:
        """Host work of a step's start beyond the page tables, staging what the device needs into `inputs`."""

    def bind(self, views: dict[str, torch.Tensor]) -> None:
        """Take this step's device views of what `stage` staged."""

    def end_step(self) -> None:
        """Called once after each forward: `end_step_device` then `end_step_host`."""
        self.end_step_device()
        self.end_step_host()

    def end_step_device(self) -> None:
        """The device work that closes a step (HiSparse: backups, window moves), with static shapes and no host
        read: a full-step CUDA graph captures it with the forward."""

    def end_step_host(self) -> None:
        """The host bookkeeping that closes a step (after the device work, or its graph's replay)."""

    def forget_step(self) -> None:
        """Drop what the seam calls of this step cached on the host (plans, fetched rows), so the step's calls can
        run again from the start: a full-step graph records them after the step's eager run."""

    def device_buffers(self) -> list[torch.Tensor]:
        """The device tensors the seam calls read and write in place (a recorded step holds their addresses)."""
        return list(self.index_keys.data.values())

    def sync_stats(self) -> None:
        """Fold counters kept on the device into `stats` (a host read; stores that count on the host: nothing)."""

    # ---- the batch seam: one call per layer for every row of the step ----
    @abstractmethod
    def write(self, layer: int, seg: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows [n, r + dR] of a KV-owning layer: row i at positions[i] of segment seg[i]."""

    def write_keys(self, layer: int, seg: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> None:
        """Store indexer keys [n, dI] of an indexer-owning layer."""
        self.index_keys.write(layer, paged_rows(self.tables.pages, seg, positions, self.page_tokens), keys)

    def select(self, layer: int, indexer: Scorer, q: torch.Tensor, w: torch.Tensor, seg: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Top-k positions [n, k] (ascending, -1 padded) of query rows q [n, HI, dI], w [n, HI] at `positions`
        of segments `seg`, over each row's own request's keys at positions <= its own."""
        return self.topk_over_keys(layer, indexer, q, w, seg, positions + 1)[0]

    def topk_over_keys(self, layer: int, indexer: Scorer, q: torch.Tensor, w: torch.Tensor, seg: torch.Tensor,
                       n_visible: torch.Tensor, with_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Exact top-k of each query row over its request's stored keys 0 .. n_visible - 1 (Triton or torch, as
        `kernels`): key indices [n, k] ascending, -1 padded, and with_scores their scores (-inf padded)."""
        keys = self.index_keys.data[layer]   # the stored keys: every scorer decodes fp8 records itself
        if self.kernels == "triton":
            from .kernels.indexer_triton import paged_topk_triton
            return paged_topk_triton(q, indexer.head_weights(w), keys, self.tables.pages, self.page_tokens, seg,
                                     n_visible, self.tables.max_end, indexer.topk, with_scores)
        return paged_topk(indexer, q, w, keys, self.tables.pages, self.page_tokens, seg, n_visible,
                          self.tables.max_end, with_scores)

    @abstractmethod
    def gather(self, layer: int, seg: torch.Tensor, sel: torch.Tensor) -> RowSource:
        """The rows of every query row's selection sel [n, k] (positions, -1 = none: any finite row) as read by
        `layer`; the returned callable decodes a block of query rows at a time (memory stays bounded)."""

    def attend(self, layer: int, q_lat: torch.Tensor, q_rope: torch.Tensor | None, seg: torch.Tensor,
               sel: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse MLA of every query row over its selection: olat [n, H, r], lse [n, H] (-inf: nothing selected).

        q_lat [n, H, r], q_rope [n, H, dR] or None (NoPE), sel [n, k]. Query rows go in blocks whose decoded rows
        stay under ATTEND_BLOCK_ELEMS (the Triton kernel reads the stored bytes directly)."""
        if self.kernels == "triton":
            from .kernels.sparse_mla_triton import sparse_mla_rows
            store, idx, extra = self.stored_rows(layer, seg, sel)
            return sparse_mla_rows(q_lat, q_rope, store, idx, self.layout, scale, extra=extra)
        rows = self.gather(layer, seg, sel)
        n, H, r = q_lat.shape
        olat, lse = torch.empty_like(q_lat), q_lat.new_empty(n, H)
        block = max(1, ATTEND_BLOCK_ELEMS // max(1, sel.shape[1] * self.cfg.latent_dim))
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            olat[lo:hi], lse[lo:hi] = sparse_mla(q_lat[lo:hi], None if q_rope is None else q_rope[lo:hi],
                                                 rows(lo, hi), sel[lo:hi] >= 0, scale, r)
        return olat, lse

    @abstractmethod
    def stored_rows(self, layer: int, seg: torch.Tensor, sel: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Where the selected rows' bytes are, for the Triton kernel: (store [rows, row_bytes] uint8, idx [n, k]
        its rows, -1 where nothing is selected, and extra rows read by an idx >= rows as extra[idx - rows])."""

    # ---- prefix caching: in units of `prefix_unit` tokens, each filling `unit_pages` whole pages ----
    @property
    def prefix_caching(self) -> bool:
        return self.pages.cache is not None

    @property
    def prefix_unit(self) -> int:
        """Tokens per cache unit (a page; a DCP shard: a block whose share fills whole pages on every rank)."""
        return self.page_tokens

    @property
    def unit_pages(self) -> int:
        """Pages of this store one cache unit fills."""
        return 1

    def unit_page_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys of the pages of cache units `keys` (`unit_pages` per unit, in order)."""
        return list(keys)

    def admit(self, req: Hashable, n_tokens: int, tokens: Sequence[int] = ()) -> int | None:
        """Reserve room for n_tokens positions of req (waiting, holding nothing), starting it from the longest
        cached run of whole cache units of `tokens` (the tokens whose rows it may reuse): how many tokens it
        starts from, or None (nothing changed) when it does not fit now."""
        chain = self.unit_chain(req, len(tokens) // self.prefix_unit, lambda s, n: list(tokens[s:s + n]))
        m = self.unit_pages
        pages = self.pages.cache.lookup(self.unit_page_keys(chain)) if chain else []
        units = len(pages) // m
        if units:
            self.pages.share(req, pages[:units * m])
        if not self.reserve(req, n_tokens):
            self.pages.free(req)
            return None
        if self.prefix_caching:
            self.stats.prefix_queries += len(tokens)
            self.stats.prefix_hits += units * self.prefix_unit
            self.committed[req] = units
        if units:
            self.attached(req, units * self.prefix_unit, chain[:units])
        return units * self.prefix_unit

    def unit_chain(self, req: Hashable, n: int, token_slice: Callable[[int, int], list[int]]) -> list[bytes]:
        """The keys of req's first n cache units ([] without prefix caching); its chain is kept, and extended from
        token_slice(start, n) (its token ids) where it is shorter."""
        if self.pages.cache is None:
            return []
        U, chain = self.prefix_unit, self.chains.setdefault(req, [])
        if len(chain) < n:
            known = len(chain) * U
            chain += page_keys(token_slice(known, n * U - known), U, chain[-1] if chain else self.salt)
        return chain[:n]

    def attach_units(self, req: Hashable, keys: list[bytes]) -> int:
        """Start req (holding nothing) from the cached units `keys`, as another party decided (a DCP follower
        replaying rank 0, a vLLM worker its scheduler's plan): every one must be cached here. Tokens attached."""
        m = self.unit_pages
        pages = self.pages.cache.lookup(self.unit_page_keys(keys)) if keys else []
        if len(pages) < len(keys) * m:
            raise RuntimeError(f"prefix cache: request {req!r} is to start from {len(keys)} cached units, this store "
                               f"holds the first {len(pages) // m} of them")
        if pages:
            self.pages.share(req, pages)
            self.chains[req], self.committed[req] = list(keys), len(keys)
            self.attached(req, len(keys) * self.prefix_unit, keys)
        return len(keys) * self.prefix_unit

    def attached(self, req: Hashable, n_tokens: int, keys: list[bytes]) -> None:
        """req starts from its first n_tokens positions, cached (units `keys`; their pages are in its table): what
        the store keeps per request besides its pages follows (HiSparse: the resident window)."""

    def commit_prefix(self, req: Hashable, token_slice: Callable[[int, int], list[int]], n_computed: int) -> None:
        """Cache the units of req that its first n_computed positions (rows written) fill; token_slice(start, n)
        gives its token ids."""
        first, done = self.committed.get(req, 0), n_computed // self.prefix_unit
        if self.pages.cache is not None and done > first:
            self.cache_units(req, first, self.unit_chain(req, done, token_slice)[first:])

    def cache_units(self, req: Hashable, first: int, keys: list[bytes]) -> None:
        """Cache req's units first, first + 1, ... (keys `keys`) under their pages in its table."""
        m = self.unit_pages
        table = self.pages.tables[req][first * m:]
        for page, key in zip(table, self.unit_page_keys(keys)):
            self.pages.cache.add(key, page)
        self.committed[req] = first + len(keys)

    def reset_prefix_cache(self) -> int:
        """Drop every cached page (parked pages are freed; held ones are no longer cached); how many were."""
        cache = self.pages.cache
        if cache is None:
            return 0
        n = len(cache)
        self.pages.evict(self.pages.parked_pages)
        cache.forget_held()
        return n

    def evict_units(self, keys: Sequence[bytes]) -> None:
        """Evict cached units no request holds, by key (as another party decided: a vLLM scheduler's plan)."""
        self.pages.evict_keys(self.unit_page_keys(keys))

    def cached_pages(self) -> int:
        """Pages the prefix cache holds (whether or not a request holds them too)."""
        return len(self.pages.cache) if self.pages.cache is not None else 0

    # ---- request lifecycle ----
    def release(self, req: Hashable) -> None:
        """Free every row, key and slot the request holds (cached pages stay cached)."""
        self.pages.free(req)
        self.reserved.pop(req, None)
        self.chains.pop(req, None)
        self.committed.pop(req, None)

    def truncate(self, req: Hashable, length: int) -> None:
        """Forget positions >= length (speculative rollback): no later gather may see their old rows.

        Positions past a request's length are never selected (selection is causal) and are overwritten by the
        next write, so resident storage needs nothing; HiSparse drops their hot-buffer slots."""

    def reserve_device(self, max_seqs: int, max_tokens: int, step_rows: int) -> None:
        """Allocate the device stores for max_seqs requests of max_tokens tokens and step_rows new rows per step
        now: a server that knows its limits then never grows a store while serving within them (page ids stay
        below the peak pages in use: the page table hands out the lowest never-used id last)."""
        self.index_keys.fit(max_seqs * self.pages_for(max_tokens))

    def device_nbytes(self) -> int:
        """Device bytes the stores hold (allocated, used or not): every device buffer, and what a store grows on
        demand counted at its limit."""
        return sum(t.nbytes for t in self.device_buffers())

    def working_set_bytes(self) -> int:
        """Device bytes one request holds whatever its length (HiSparse: its arena slot and LRU metadata)."""
        return 0

    def max_working_sets(self) -> int | None:
        """How many requests' working sets the device budget holds (None: unbounded)."""
        return None

    def request_device_bytes(self, n_tokens: int) -> int:
        """Device bytes one request of n_tokens tokens holds: its indexer keys and working set (and, resident,
        its latent rows)."""
        return self.pages_for(n_tokens) * self.index_keys.bytes_per_page() + self.working_set_bytes()

    def index_cache_bytes(self, req: Hashable | None = None) -> int:
        """Device bytes of indexer keys held (by one request, or by all running requests: cached pages no request
        holds are not counted)."""
        pages = len(self.pages.refs) if req is None else self.pages.pages_of(req)
        return pages * self.index_keys.bytes_per_page()

    def resident_rows(self) -> int:
        """Latent rows held in resident device pages (hybrid offload; 0 for other stores)."""
        return 0

    def residency(self, req: Hashable) -> float:
        """Fraction of a request's pages whose rows are on the device."""
        return 0.0

    # ---- capacity and admission: a request reserves the positions it may write (grown as it decodes) ----
    def token_capacity(self) -> int | None:
        """Tokens the latent store can hold in all (None: unbounded)."""
        return None

    def pages_for(self, n_tokens: int) -> int:
        """Pages n_tokens tokens take."""
        return -(-n_tokens // self.page_tokens)

    def _rounded(self, n_tokens: int) -> int:
        return self.pages_for(n_tokens) * self.page_tokens

    def tokens_unreserved(self) -> int | None:
        """Tokens still free for new reservations, parked cached pages not counted (None: unbounded)."""
        cap = self.token_capacity()
        return None if cap is None else cap - sum(self.reserved.values()) - self.pages.parked_pages * self.page_tokens

    def can_ever_admit(self, n_tokens: int) -> bool:
        cap = self.token_capacity()
        return cap is None or self._rounded(n_tokens) <= cap

    def reserve(self, req: Hashable, n_tokens: int) -> bool:
        """Hold room for n_tokens positions of req (a reservation only grows); False (nothing changed) if it does
        not fit now."""
        free = self.tokens_unreserved()
        need = self._rounded(n_tokens) - self.reserved.get(req, 0)
        if need <= 0:
            return True
        if free is not None and need > free:   # evict cached pages nobody holds, if that makes room
            if need > free + self.pages.parked_pages * self.page_tokens:
                return False
            self.pages.evict(-(-(need - free) // self.page_tokens))
        self.reserved[req] = self.reserved.get(req, 0) + need
        return True

    def usage_ratio(self) -> float:
        """Fraction of the latent store's capacity reserved (0.0 when unbounded)."""
        cap = self.token_capacity()
        return sum(self.reserved.values()) / cap if cap else 0.0
