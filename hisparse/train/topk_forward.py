"""The top-k-only training forward: ML4's own modules with autograd at lengths where no [T, T] tensor fits.

`forward.train_forward` builds every layer's dense [B, H, T, T] logits (its indexer target is the dense
attention), which costs O(T^2) memory and time: ~40 s a step at 8k on one core, out of reach at 32k. This forward
never builds them. Per indexer owner, Sel(t) comes from `Indexer.select`, the inference path itself (the fused CPU
kernel on large inputs, scores never stored), so the selections are exactly those `hisparse serve` makes; each
query then attends in the absorbed MLA form (spec §3.7: q_N W_UK against the latent c, output through W_UV) over
the rows it gathers, O(T k) memory.

Indexer loss (DeepSeek-V3.2's sparse stage): KL(p_t || softmax I[t, C_t]) over a candidate set C_t, p_t the
layer's own attention distribution over C_t averaged over heads, detached, and the indexer reading a detached
input. DeepSeek-V3.2 takes C_t = Sel(t); here C_t = Sel(t) plus the `recent` newest keys (t - recent, t], so a
nearby key that far-away look-alikes crowded out of Sel(t) still pulls the indexer back up (at long lengths that
crowding, not the needle, is what breaks). The model's attention itself reads Sel(t) only, as at inference.
Sharers attend over their owner's Sel(t). The KL comes back per query, because the few queries that copy a needle
are where a long prompt's crowding breaks an answer, and a mean over all T queries gives them ~1e-4 of the weight.

Memory: what a query reads (its K gathered latent rows, rope keys and indexer keys, and the logits over them)
is computed for `query_chunk` queries at a time under activation checkpointing, so the autograd graph keeps only
each chunk's inputs and the pieces are rebuilt one chunk at a time in the backward pass. Peak memory then grows
with T (the per-row tensors) rather than with T k (the gathers): at 128k the unchunked forward needs ~50 GB.
Values are the unchunked ones: each query's logits and output are computed by the same per-row operations; only
the order in which the chunks' gradients add up differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from ..model.indexer import Indexer
from ..model.ml4 import ML4, Block
from .forward import layers_forward, queries_and_latents, sequence_rope


@dataclass
class Candidates:
    """One indexer owner's keys per query, as rows of the flattened [B T] batch."""
    rows: torch.Tensor          # [B T, k + recent] row index into [B T] (own sequence start where unused)
    selected: torch.Tensor      # [B T, k + recent] bool: in Sel(t) (what attention reads)
    scored: torch.Tensor        # [B T, k + recent] bool: in C_t (what the indexer KL reads)
    recent: int                 # the last `recent` columns are the keys t, t - 1, ..., t - recent + 1


@dataclass
class TopkBatchState:
    """What the layers of one top-k-only forward share."""
    B: int
    T: int
    recent: int
    query_chunk: int
    positions: torch.Tensor                 # [B T]
    cos: torch.Tensor                       # [B T, dR/2]
    sin: torch.Tensor
    widened: dict[int, int] = field(default_factory=dict)   # owner layer -> first query that reads recent keys too
    latents: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)  # c, k_rope
    candidates: dict[int, Candidates] = field(default_factory=dict)      # owner layer -> its candidates
    index_losses: list[torch.Tensor] = field(default_factory=list)      # per owner: each query's KL [B T]


QUERY_CHUNK = 8192      # queries per checkpointed piece: ~0.5 GB of gathered rows at K = 128, r = 64 (fp32)


def topk_forward(model: ML4, tokens: torch.Tensor, recent: int, query_chunk: int = QUERY_CHUNK,
                 widened: dict[int, int] | None = None, kept: dict[int, Candidates] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> (logits [B T, V], each owning layer's indexer KL per query [L, B T], so a caller can
    weight some queries (a needle's answer) above the rest); attention over Sel(t) only
    (each indexer's own top-k, as at inference), `query_chunk` queries at a time. `widened` is an ablation that
    training never sets: for owner layer l -> position p, queries at positions >= p of that owner (and its sharers)
    attend over Sel(t) plus the `recent` newest keys, i.e. over all of C_t. `kept`, if given, receives each
    owner's candidates (for a benchmark to inspect)."""
    B, T = tokens.shape
    st = TopkBatchState(B, T, recent, query_chunk, *sequence_rope(model, tokens), widened=dict(widened or {}))
    logits = layers_forward(model, tokens, st, attention_forward)
    if kept is not None:
        kept.update(st.candidates)
    return logits, torch.stack(st.index_losses)


def attention_forward(block: Block, x: torch.Tensor, st: TopkBatchState) -> torch.Tensor:   # x [B T, D]
    mla, spec = block.attention, block.spec
    q_nope, q_rope = queries_and_latents(block, x, st)
    c, k_rope = st.latents[spec.kv_source]                                          # [N, r], [N, dR]
    index = None
    if mla.indexer is not None:
        index = mla.indexer.project(x.detach(), st.positions, st.cos, st.sin)       # [N, HI, dI], [N, dI], [N, HI]
        st.candidates[spec.index] = candidates(mla.indexer, *index, st, st.widened.get(spec.index))
    return sparse_attention(block, q_nope, q_rope, c, k_rope, st.candidates[spec.index_source], index, st)


def sparse_attention(block: Block, q_nope: torch.Tensor, q_rope: torch.Tensor | None, c: torch.Tensor,
                     k_rope: torch.Tensor | None, cand: Candidates,
                     index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, st) -> torch.Tensor:
    """n query rows q_nope [n, H, dN], q_rope [n, H, dR] over their candidates' rows of the latents c [S, r],
    k_rope [S, dR], `st.query_chunk` rows at a time -> the attention output [n, D]; an owner's `index` (qi [n,
    HI, dI], its keys ki [S, dI], wi [n, HI]) adds each row's indexer KL [n] to st.index_losses."""
    mla, cfg = block.attention, block.attention.cfg
    n, H, dN = q_nope.shape[0], cfg.n_heads, cfg.qk_nope_head_dim
    w_kvb = mla.wkv_b.weight.view(H, dN + cfg.v_head_dim, cfg.kv_lora_rank)
    q_lat = torch.einsum("nhd,hdc->nhc", q_nope, w_kvb[:, :dN])                      # [n, H, r]
    outs, kls = [], []
    for a in range(0, n, st.query_chunk):
        rows = slice(a, a + st.query_chunk)
        piece = (q_lat[rows], None if q_rope is None else q_rope[rows], c, k_rope, cand.rows[rows],
                 cand.selected[rows], cand.scored[rows], *((index[0][rows], index[1], index[2][rows])
                                                           if index is not None else ()))
        o, kl = (checkpoint(attend, mla, *piece, use_reentrant=False) if n > st.query_chunk
                 else attend(mla, *piece))
        outs.append(o)
        kls.append(kl)
    if index is not None:
        st.index_losses.append(torch.cat(kls))
    o = torch.einsum("nhc,hdc->nhd", torch.cat(outs), w_kvb[:, dN:])                 # [n, H, dV]
    return mla.wo(o.reshape(n, -1))


def attend(mla, q_lat: torch.Tensor, q_rope: torch.Tensor | None, c: torch.Tensor, k_rope: torch.Tensor | None,
           rows: torch.Tensor, selected: torch.Tensor, scored: torch.Tensor, qi: torch.Tensor | None = None,
           ki: torch.Tensor | None = None, wi: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of n queries: (latent output [n, H, r] over Sel(t), each query's indexer KL [n] (empty without
    an indexer)). q_lat [n, H, r] against the gathered latents c[rows] [n, K, r]."""
    c_sel = gather(c, rows)                                                          # [n, K, r]
    logits = torch.einsum("nhc,nkc->nhk", q_lat, c_sel)                              # [n, H, K]
    if q_rope is not None:
        logits = logits + torch.einsum("nhd,nkd->nhk", q_rope, gather(k_rope, rows))
    logits = logits * mla.scale
    kl = logits.new_zeros(0)
    if qi is not None:
        with torch.no_grad():
            target = torch.softmax(logits.masked_fill(~scored[:, None], float("-inf")), dim=-1).mean(1)
        kl = indexer_kl(mla.indexer, qi, ki, wi, rows, scored, target)
    p = torch.softmax(logits.masked_fill(~selected[:, None], float("-inf")), dim=-1)
    return torch.einsum("nhk,nkc->nhc", p, c_sel), kl


def gather(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [N, d] at rows [N, K] -> [N, K, d] (index_select: a row copy each way, unlike advanced indexing's
    backward, which sorts the indices)."""
    return x.index_select(0, rows.flatten()).view(*rows.shape, x.shape[-1])


def candidates(indexer: Indexer, qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, st: TopkBatchState,
               widen_from: int | None = None) -> Candidates:
    """Every sequence's `sequence_candidates`, as rows of the flattened [B T] batch."""
    B, T = st.B, st.T
    t = torch.arange(T, device=qi.device)
    parts = [sequence_candidates(indexer, qi[b * T:(b + 1) * T], ki[b * T:(b + 1) * T], wi[b * T:(b + 1) * T], t,
                                 st.recent, widen_from) for b in range(B)]
    return Candidates(torch.cat([p.rows + b * T for b, p in enumerate(parts)]),
                      torch.cat([p.selected for p in parts]), torch.cat([p.scored for p in parts]), st.recent)


def sequence_candidates(indexer: Indexer, qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, t: torch.Tensor,
                        recent: int, widen_from: int | None = None) -> Candidates:
    """One sequence's keys ki [S, dI] (in order) for queries qi [n, HI, dI], wi [n, HI], query j the key at t[j]:
    Sel(t) over keys 0..t[j] by the inference path, then the `recent` newest keys t[j], t[j] - 1, ... not already
    in it (selected too for queries with t >= `widen_from`, the ablation of `topk_forward`'s `widened`); rows
    index ki (0 where unused)."""
    with torch.no_grad():
        sel = indexer.select(qi.detach(), wi.detach(), ki.detach(), t)                          # [n, k']
        near = t[:, None] - torch.arange(recent, device=qi.device)                              # [n, W]
        padded = sel.masked_fill(sel < 0, ki.shape[0])       # ascending per row once -1 pads sort last
        at = torch.searchsorted(padded, near.clamp(min=0)).clamp(max=sel.shape[1] - 1)
        fresh = (near >= 0) & (padded.gather(1, at) != near)
        keys = torch.cat((sel, near), dim=1)                                                     # [n, K]
        widen = fresh & (near[:, :1] >= widen_from) if widen_from is not None else torch.zeros_like(fresh)
        selected = torch.cat((sel >= 0, widen), dim=1)
        scored = torch.cat((sel >= 0, fresh), dim=1)
    return Candidates(keys.clamp(min=0), selected, scored, recent)


def newest_missing(cand: Candidates, newest: int) -> torch.Tensor:
    """How many of each query's `newest` keys (t - newest, t] are not in its Sel(t) -> [B T] (positions before
    the sequence's start count as present); newest <= the forward's `recent`."""
    recent = cand.scored[:, cand.scored.shape[1] - cand.recent:]     # keys t, t - 1, ...: scored iff not in Sel(t)
    return recent[:, :newest].sum(1)


def indexer_kl(indexer: Indexer, qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, rows: torch.Tensor,
               scored: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per query of qi [n, HI, dI]: KL(target || softmax of I over its scored candidates, the keys ki[rows]
    [n, K, dI]) -> [n]; I as spec §3.6."""
    dots = torch.einsum("nhd,nkd->nhk", qi, gather(ki, rows)).relu()                         # [n, HI, K]
    scores = torch.einsum("nh,nhk->nk", indexer.head_weights(wi), dots).masked_fill(~scored, float("-inf"))
    logq = torch.log_softmax(scores, dim=-1).masked_fill(~scored, 0.0)
    return (torch.xlogy(target, target) - target * logq).sum(-1)
