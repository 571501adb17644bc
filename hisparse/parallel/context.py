"""The DCP collectives of one layer (spec §7): exact global top-k merge and the LSE combine of attention partials.

Hidden states are replicated; each rank holds the latent rows and indexer keys of the positions it owns
(`ShardedKV`). Queries are replicated too, unless tensor parallelism splits the heads: then (as vLLM's DCP inside
TP) a rank all-gathers the queries of its DCP group's heads, attends all of them over its own rows, and keeps the
combine of its own heads. Indexer: a rank scores its own keys, takes its exact local top-k under the normative key
(score desc, position asc), and the packed (score, global position) candidates of all ranks are merged with the
same key, so every rank gets the single-rank Sel(t). Attention: a rank attends over Sel(t) ∩ Own_r (an empty
shard gives lse = -inf and a zero output), and the (olat, lse) partials are combined by log-sum-exp.
"""

from __future__ import annotations

import torch

from ..kv.scoring import select_topk
from .group import RankGroup
from .sharding import Sharding


class DCPContext:
    """One rank's view of a DCP group with interleave I: its sharding and the two collective steps of a layer."""

    def __init__(self, group: RankGroup, interleave: int = 1, heads_split: bool = False):
        self.group, self.heads_split = group, heads_split
        self.sharding = Sharding(group.size, interleave, group.rank)

    def gather_heads(self, x: torch.Tensor | None, layer: int) -> torch.Tensor | None:
        """x [N, h, d] (this rank's heads) -> [N, R h, d], the heads of every rank of the group in rank order
        (x itself when the heads are replicated)."""
        if x is None or not self.heads_split:
            return x
        every = self.group.all_gather(x, f"layer {layer} queries")                       # [R, N, h, d]
        return every.permute(1, 0, 2, 3).flatten(1, 2)

    def merge_topk(self, scores: torch.Tensor, where: torch.Tensor, k: int, layer: int) -> torch.Tensor:
        """Sel(t) [N, k] (ascending global positions, -1 padded) from every rank's local candidates: this rank's
        scores [N, k] (-inf pads) at global positions where [N, k] (-1 pads)."""
        N = scores.shape[0]
        cand = torch.stack((scores.to(torch.float64), where.to(torch.float64)), dim=-1)    # [N, k, 2]
        every = self.group.all_gather(cand, f"layer {layer} indexer top-k")               # [R, N, k, 2]
        every = every.permute(1, 0, 2, 3).reshape(N, -1, 2)                             # [N, R k, 2]
        where, order = every[..., 1].long().sort(dim=1)        # position order: select_topk breaks ties by column
        cols = select_topk(every[..., 0].gather(1, order), k)                           # [N, k], -1 padded
        return where.gather(1, cols.clamp(min=0)).masked_fill(cols < 0, -1)

    def combine(self, olat: torch.Tensor, lse: torch.Tensor, layer: int) -> torch.Tensor:
        """olat [N, H, r] = the LSE combine of every rank's partial (olat_r [N, H, r], lse_r [N, H]); with split
        heads, the H = R h heads of `gather_heads` in, this rank's h out [N, h, r]."""
        r = olat.shape[-1]
        acc = torch.promote_types(olat.dtype, torch.float32)       # lse and the combine: at least fp32
        part = torch.cat((olat.to(acc), lse.to(acc)[..., None]), dim=-1)                 # olat_r || lse_r
        if self.heads_split:   # each head's partials go to its owner only: [R, N, h, r + 1] from every rank
            R = self.group.size
            part = part.unflatten(1, (R, -1)).transpose(0, 1)                            # [R, N, h, r + 1]
            every = self.group.all_to_all(part, f"layer {layer} attention")
        else:
            every = self.group.all_gather(part, f"layer {layer} attention")            # [R, N, H, r + 1]
        lse_r = every[..., r]
        weight = torch.exp(lse_r - torch.logsumexp(lse_r, dim=0))                       # shard masses; -inf -> 0
        return (weight[..., None] * every[..., :r]).sum(dim=0).to(olat.dtype)
