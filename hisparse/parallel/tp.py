"""Tensor and expert parallelism for ML4, applied from outside the model (as gpt-fast's tp.py and DeepSeek-V3.2's
parallel linears do): `TensorParallel(group).shard(model)` narrows a meta-device ML4 to one rank's share, adds the
collectives as forward hooks, and returns the loader's `select` (the region of every checkpoint tensor this rank
reads, so each rank reads only its slices). Sharding needs only the rank and the size: a rank loads its share
before it joins the group, and `bind` hands the hooks the group afterwards.

The split over R ranks (rank i; every split size must divide by R):
- attention: heads [i H/R, (i+1) H/R): wq and wkv_b rows (column-parallel), SSMax rows, wo columns (row-parallel,
  its output all-reduced). wkv_a_with_mqa and kv_a_norm (MLA's one latent head) are replicated, so every rank
  computes the same latent rows; where they are stored is the LatentKV's business (DCP shards them).
- indexer: replicated. Its keys are one shared head per token (like the latent), so splitting its 32 query heads
  would save little compute but add a collective per index-owning layer; replicated, every rank computes the
  single-rank top-k itself (or, under DCP, its exact local candidates).
- dense FFN and the shared experts: w1/w3 rows, w2 columns.
- routed experts: experts [i E/R, (i+1) E/R) whole on rank i (expert parallelism), the others absent (None); the
  router is replicated; the MoE output (routed + shared partials) is all-reduced once.
- tok_embeddings: vocab rows [i V/R, (i+1) V/R) (a token outside them embeds as zeros; all-reduced); output head:
  vocab rows, logits all-gathered.
- the DSpark drafter (`mtp_dspark.*`): replicated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .group import RankGroup
from ..model.attention import MLA
from ..core.config import ModelConfig
from ..model.linear import Linear
from ..model.ml4 import ML4
from ..model.moe import MoE, SwiGLU
from ..model.weights import Region, Select


def split(n: int, size: int, rank: int, what: str) -> slice:
    """Rank `rank`'s block of n items split over `size` ranks (ValueError naming `what` unless size divides n)."""
    if n % size:
        raise ValueError(f"tensor parallelism over {size} ranks: {what} ({n}) does not divide by {size}")
    k = n // size
    return slice(rank * k, (rank + 1) * k)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the vocabulary; the embeddings of the whole vocabulary are the sum
    over ranks (a token outside a rank's rows embeds as zeros there), so the sum is exact."""

    def __init__(self, num_embeddings: int, dim: int, start: int, tp: "TensorParallel"):
        super().__init__(num_embeddings, dim)
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:   # ids [...] -> [..., D]
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight) * mine[..., None].to(self.weight.dtype)
        return self.tp.comm.all_reduce(x, "the token embeddings")


class TensorParallel:
    """Shards a meta-device ML4 for rank `rank` of a tensor-parallel group of `size` ranks; `bind` gives it the
    group its collectives run in (before the first forward)."""

    def __init__(self, rank: int, size: int, group: RankGroup | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"tensor parallelism: rank {rank} of {size}")
        self.rank, self.size, self.group = rank, size, None
        self.regions: dict[str, Region] = {}
        if group is not None:
            self.bind(group)

    def bind(self, group: RankGroup) -> None:
        if (group.rank, group.size) != (self.rank, self.size):
            raise ValueError(f"tensor parallelism: sharded for rank {self.rank} of {self.size}, bound to rank "
                             f"{group.rank} of {group.size}")
        self.group = group

    @property
    def comm(self) -> RankGroup:
        if self.group is None:
            raise RuntimeError("tensor parallelism: forward before the rank joined its group (bind)")
        return self.group

    def shard(self, model: ML4) -> Select | None:
        """Narrow `model` (on the meta device) to this rank's share and hook in its collectives; the loader's
        select for that share (None on one rank: everything)."""
        if self.size == 1:
            return None
        if model.cfg.tied_embeddings:
            raise ValueError("tensor parallelism: tied embeddings are not supported (ML4's head is untied)")
        with torch.device("meta"):
            self._vocab(model)
            for block in model.layers:
                prefix = f"layers.{block.spec.index}."
                self._attention(prefix + "attention.", block.attention)
                if block.spec.ffn == "dense":
                    self._swiglu(prefix + "feed_forward.", block.feed_forward)
                    self._reduce_output(block.feed_forward, f"layer {block.spec.index} feed-forward")
                else:
                    self._moe(prefix + "moe.", block.moe)
                    self._reduce_output(block.moe, f"layer {block.spec.index} MoE")
        regions = self.regions
        return lambda name, shape: regions.get(name)

    # ---- pieces ----
    def _vocab(self, model: ML4) -> None:
        V, D = model.cfg.vocab_size, model.cfg.dim
        rows = split(V, self.size, self.rank, "vocab_size")
        model.tok_embeddings = VocabParallelEmbedding(rows.stop - rows.start, D, rows.start, self)
        self.regions["tok_embeddings.weight"] = (rows,)
        model.output = self._column(model.output, "output.", rows)

        def gather_logits(module: nn.Module, args: tuple, z: torch.Tensor) -> torch.Tensor:
            every = self.comm.all_gather(z, "the output logits")        # [R, ..., V/R]
            return every.movedim(0, -2).flatten(-2)                      # [..., V] in vocabulary order
        model.output.register_forward_hook(gather_logits)

    def _attention(self, prefix: str, attn: MLA) -> None:
        cfg, R, i = attn.cfg, self.size, self.rank
        heads = split(cfg.n_heads, R, i, "n_heads")
        dq, dkv, dV = attn.q_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
        attn.n_heads = heads.stop - heads.start
        attn.wq = self._column(attn.wq, prefix + "wq.", slice(heads.start * dq, heads.stop * dq))
        attn.wkv_b = self._column(attn.wkv_b, prefix + "wkv_b.", slice(heads.start * dkv, heads.stop * dkv))
        attn.wo = self._row(attn.wo, prefix + "wo.", slice(heads.start * dV, heads.stop * dV))
        self._reduce_output(attn.wo, f"{prefix.removesuffix('.')} output")
        if attn.ssmax_scaling is not None:
            attn.ssmax_scaling = nn.Parameter(torch.empty(attn.n_heads, 2))
            self.regions[prefix + "ssmax_scaling"] = (heads,)

    def _swiglu(self, prefix: str, ffn: SwiGLU) -> None:
        hidden = split(ffn.w1.out_features, self.size, self.rank, prefix + "hidden")
        ffn.w1 = self._column(ffn.w1, prefix + "w1.", hidden)
        ffn.w3 = self._column(ffn.w3, prefix + "w3.", hidden)
        ffn.w2 = self._row(ffn.w2, prefix + "w2.", hidden)

    def _moe(self, prefix: str, moe: MoE) -> None:
        mine = split(len(moe.experts), self.size, self.rank, "num_experts")
        for e in range(len(moe.experts)):
            if not mine.start <= e < mine.stop:
                moe.experts[e] = None
        moe.local_experts = range(mine.start, mine.stop)
        self._swiglu(prefix + "shared_experts.", moe.shared_experts)

    # ---- parallel linears: a smaller Linear on the meta device and the checkpoint region it loads ----
    def _column(self, linear: Linear, prefix: str, rows: slice) -> Linear:
        """Output rows `rows` of `linear` (column-parallel: the output stays split)."""
        self.regions[prefix + "weight"] = (rows,)
        return Linear(linear.in_features, rows.stop - rows.start, bias=False)

    def _row(self, linear: Linear, prefix: str, cols: slice) -> Linear:
        """Input columns `cols` of `linear` (row-parallel: each rank's output is a partial sum)."""
        self.regions[prefix + "weight"] = (slice(None), cols)
        return Linear(cols.stop - cols.start, linear.out_features, bias=False)

    def _reduce_output(self, module: nn.Module, what: str) -> None:
        module.register_forward_hook(lambda m, args, out: self.comm.all_reduce(out, what))


def check_splits(cfg: ModelConfig, size: int) -> None:
    """ValueError (naming the dimension) unless a model of `cfg` splits over `size` tensor-parallel ranks; builds it
    on the meta device only."""
    with torch.device("meta"):
        TensorParallel(0, size).shard(ML4(cfg))


def shard_for(group: RankGroup | None) -> Callable[[ML4], Select | None] | None:
    """The loader's `shard` hook for a joined tensor-parallel group (None: no tensor parallelism)."""
    return None if group is None or group.size == 1 else TensorParallel(group.rank, group.size, group).shard
