"""The DCP hook MLA consults on every rank (spec §7): exact global top-k and LSE-combined attention.

Queries and hidden states are replicated; each rank holds the latent rows and indexer keys of the positions it
owns (`ShardedKV`). Indexer: a rank scores its own keys, takes its exact local top-k under the normative key
(score desc, position asc), and the packed (score, global position) candidates of all ranks are merged with the
same key, so every rank gets the single-rank Sel(t). Attention: a rank attends over Sel(t) ∩ Own_r (an empty
shard gives lse = -inf and a zero output), and the (olat, lse) partials are combined by log-sum-exp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..model.attention import sparse_mla
from ..model.indexer import FUSED_MIN_PAIRS, SCORE_BLOCK_ELEMS, Indexer, index_scores, select_topk
from ..model.kernels import indexer_topk
from .group import DCPGroup
from .sharding import Sharding

if TYPE_CHECKING:
    from ..model.attention import AttentionBatch


class DCPContext:
    """One rank's view of a DCP group with interleave I: its sharding and the two collective steps of a layer."""

    def __init__(self, group: DCPGroup, interleave: int = 1):
        self.group = group
        self.sharding = Sharding(group.size, interleave, group.rank)

    def write_keys(self, k: torch.Tensor, b: "AttentionBatch", layer: int) -> None:
        """Store the indexer keys k [N, dI] of the batch's positions that this rank owns."""
        for seg, sl in zip(b.segments, b.slices):
            pos = b.positions[sl]
            own = self.sharding.owner(pos) == self.sharding.rank
            if bool(own.any()):
                b.kv.index_cache.write(layer, seg.req, self.sharding.local(pos[own]), k[sl][own])

    def select(self, indexer: Indexer, q: torch.Tensor, w: torch.Tensor, b: "AttentionBatch",
               layer: int) -> list[torch.Tensor]:
        """Sel(t) per segment [T, min(k, S)] (ascending positions, -1 padded) from this layer's own keys.

        q [N, HI, dI], w [N, HI] of the batch's query rows; this rank scores only its own keys (`write_keys`)."""
        sh, topk = self.sharding, indexer.topk
        N = q.shape[0]
        cand = q.new_full((N, topk, 2), -1.0, dtype=torch.float64)      # (score, global position) per slot
        cand[..., 0] = float("-inf")
        for seg, sl in zip(b.segments, b.slices):
            pos = b.positions[sl]
            n_local = sh.count_owned(seg.start + seg.length)
            if n_local and sl.stop > sl.start:
                keys = b.kv.index_cache.prefix(layer, seg.req, n_local)                  # [S_r, dI] by local index
                scores, where = self.local_topk(indexer, q[sl], w[sl], keys, pos)
                cand[sl, : scores.shape[1], 0] = scores.to(torch.float64)
                cand[sl, : scores.shape[1], 1] = where.to(torch.float64)
        every = self.group.all_gather(cand, f"layer {layer} indexer top-k")               # [R, N, k, 2]
        every = every.permute(1, 0, 2, 3).reshape(N, -1, 2)                             # [N, R k, 2]
        where, order = every[..., 1].long().sort(dim=1)        # position order: select_topk breaks ties by column
        cols = select_topk(every[..., 0].gather(1, order), topk)                        # [N, k], -1 padded
        sel = where.gather(1, cols.clamp(min=0)).masked_fill(cols < 0, -1)
        return [sel[sl, : min(topk, seg.start + seg.length)] for seg, sl in zip(b.segments, b.slices)]

    def local_topk(self, indexer: Indexer, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact top-k of this rank's keys [S_r, dI] (local index order = position order) for queries q [T, HI, dI]
        at `positions` [T]: packed candidates, scores [T, min(k, S_r)] (-inf pads) and global positions (-1 pads).

        Key j is visible to t iff j < count_owned(p_t + 1). The scores are the single-rank ones bit for bit:
        index_scores and the fused kernel round each score independently of S (the path choice mirrors
        Indexer.select)."""
        sh, wr, k = self.sharding, indexer.head_weights(w), indexer.topk
        n_visible = sh.count_owned(positions + 1)                                       # [T]
        T, S = q.shape[0], keys.shape[0]
        if T * S >= FUSED_MIN_PAIRS and indexer_topk.supports(q, wr, keys) and indexer_topk.available():
            cols, scores = indexer_topk.fused_topk(q, wr, keys, n_visible, k, with_scores=True)
        else:
            rows = max(1, SCORE_BLOCK_ELEMS // max(1, indexer.n_heads * S))
            cols, scores = [], []
            for i in range(0, T, rows):   # blocks of queries bound the score memory
                s = index_scores(q[i:i + rows], wr[i:i + rows], keys, n_visible[i:i + rows] - 1)
                c = select_topk(s, k)
                cols.append(c)
                scores.append(s.gather(1, c.clamp(min=0)).masked_fill(c < 0, float("-inf")))
            cols, scores = torch.cat(cols), torch.cat(scores)
        return scores, sh.global_of(cols.clamp(min=0)).masked_fill(cols < 0, -1)

    def attend(self, q_lat: torch.Tensor, q_rope: torch.Tensor | None, selections: list[torch.Tensor],
               b: "AttentionBatch", layer: int, scale: float) -> torch.Tensor:
        """olat [N, H, r] = the LSE combine of every rank's partial attention over its own selected rows.

        q_lat [N, H, r], q_rope [N, H, dR] or None (NoPE), selections per segment [T, k] (global positions)."""
        sh = self.sharding
        N, H, r = q_lat.shape
        acc = torch.promote_types(q_lat.dtype, torch.float32)       # lse and the combine: at least fp32
        part = q_lat.new_zeros(N, H, r + 1, dtype=acc)             # olat_r || lse_r
        part[..., r] = float("-inf")
        for seg, sl, sel in zip(b.segments, b.slices, selections):
            mine = (sel >= 0) & (sh.owner(sel) == sh.rank)       # Sel(t) ∩ Own_r   [T, k]
            if not bool(mine.any()):
                continue
            uniq, inv = torch.unique(sel[mine], return_inverse=True)
            rows = q_lat.new_zeros(*sel.shape, b.kv.cfg.latent_dim)                   # [T, k, r + dR]
            rows[mine] = b.kv.gather(layer, seg.req, uniq)[inv]
            olat, lse = sparse_mla(q_lat[sl], q_rope[sl] if q_rope is not None else None, rows, mine, scale, r)
            part[sl, :, :r], part[sl, :, r] = olat, lse
        every = self.group.all_gather(part, f"layer {layer} attention")                # [R, N, H, r + 1]
        lse_r = every[..., r]
        weight = torch.exp(lse_r - torch.logsumexp(lse_r, dim=0))                       # shard masses; -inf -> 0
        return (weight[..., None] * every[..., :r]).sum(dim=0).to(q_lat.dtype)
