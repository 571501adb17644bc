"""The DCP collectives of one layer (spec §7): exact global top-k merge and the LSE combine of attention partials.

Queries and hidden states are replicated; each rank holds the latent rows and indexer keys of the positions it
owns (`ShardedKV`). Indexer: a rank scores its own keys, takes its exact local top-k under the normative key
(score desc, position asc), and the packed (score, global position) candidates of all ranks are merged with the
same key, so every rank gets the single-rank Sel(t). Attention: a rank attends over Sel(t) ∩ Own_r (an empty
shard gives lse = -inf and a zero output), and the (olat, lse) partials are combined by log-sum-exp.
"""

from __future__ import annotations

import torch

from ..model.indexer import select_topk
from .group import DCPGroup
from .sharding import Sharding


class DCPContext:
    """One rank's view of a DCP group with interleave I: its sharding and the two collective steps of a layer."""

    def __init__(self, group: DCPGroup, interleave: int = 1):
        self.group = group
        self.sharding = Sharding(group.size, interleave, group.rank)

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
        """olat [N, H, r] = the LSE combine of every rank's partial (olat_r [N, H, r], lse_r [N, H])."""
        r = olat.shape[-1]
        acc = torch.promote_types(olat.dtype, torch.float32)       # lse and the combine: at least fp32
        part = torch.cat((olat.to(acc), lse.to(acc)[..., None]), dim=-1)                 # olat_r || lse_r
        every = self.group.all_gather(part, f"layer {layer} attention")                # [R, N, H, r + 1]
        lse_r = every[..., r]
        weight = torch.exp(lse_r - torch.logsumexp(lse_r, dim=0))                       # shard masses; -inf -> 0
        return (weight[..., None] * every[..., :r]).sum(dim=0).to(olat.dtype)
