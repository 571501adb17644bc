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
Sharers attend over their owner's Sel(t).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.indexer import Indexer
from ..model.ml4 import ML4, Block
from .forward import layers_forward, queries_and_latents, sequence_rope


@dataclass
class Candidates:
    """One indexer owner's keys per query, as rows of the flattened [B T] batch."""
    rows: torch.Tensor          # [B T, k + recent] row index into [B T] (own sequence start where unused)
    selected: torch.Tensor      # [B T, k + recent] bool: in Sel(t) (what attention reads)
    scored: torch.Tensor        # [B T, k + recent] bool: in C_t (what the indexer KL reads)


@dataclass
class TopkBatchState:
    """What the layers of one top-k-only forward share."""
    B: int
    T: int
    recent: int
    positions: torch.Tensor                 # [B T]
    cos: torch.Tensor                       # [B T, dR/2]
    sin: torch.Tensor
    latents: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)  # c, k_rope
    candidates: dict[int, Candidates] = field(default_factory=dict)      # owner layer -> its candidates
    index_losses: list[torch.Tensor] = field(default_factory=list)


def topk_forward(model: ML4, tokens: torch.Tensor, recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> (logits [B T, V], mean indexer KL over the owning layers); attention over Sel(t) only
    (each indexer's own top-k, as at inference)."""
    B, T = tokens.shape
    st = TopkBatchState(B, T, recent, *sequence_rope(model, tokens))
    return layers_forward(model, tokens, st, attention_forward), torch.stack(st.index_losses).mean()


def attention_forward(block: Block, x: torch.Tensor, st: TopkBatchState) -> torch.Tensor:   # x [B T, D]
    mla, spec, cfg = block.attention, block.spec, block.attention.cfg
    N, H, dN, r = st.B * st.T, cfg.n_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    q_nope, q_rope = queries_and_latents(block, x, st)
    c, k_rope = st.latents[spec.kv_source]                                          # [N, r], [N, dR]
    if mla.indexer is not None:
        qi, ki, wi = mla.indexer.project(x.detach(), st.positions, st.cos, st.sin)  # [N, HI, dI], [N, dI], [N, HI]
        st.candidates[spec.index] = candidates(mla.indexer, qi, ki, wi, st)
    cand = st.candidates[spec.index_source]
    w_kvb = mla.wkv_b.weight.view(H, dN + cfg.v_head_dim, r)
    q_lat = torch.einsum("nhd,hdc->nhc", q_nope, w_kvb[:, :dN])                      # [N, H, r]
    c_sel = gather(c, cand.rows)                                                     # [N, K, r]
    logits = torch.einsum("nhc,nkc->nhk", q_lat, c_sel)                              # [N, H, K]
    if q_rope is not None:
        logits = logits + torch.einsum("nhd,nkd->nhk", q_rope, gather(k_rope, cand.rows))
    logits = logits * mla.scale
    if mla.indexer is not None:
        with torch.no_grad():
            target = torch.softmax(logits.masked_fill(~cand.scored[:, None], float("-inf")), dim=-1).mean(1)
        st.index_losses.append(indexer_kl(mla.indexer, qi, ki, wi, cand, target))
    p = torch.softmax(logits.masked_fill(~cand.selected[:, None], float("-inf")), dim=-1)
    o = torch.einsum("nhk,nkc->nhc", p, c_sel)                                       # [N, H, r]
    o = torch.einsum("nhc,hdc->nhd", o, w_kvb[:, dN:])                               # [N, H, dV]
    return mla.wo(o.reshape(N, -1))


def gather(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [N, d] at rows [N, K] -> [N, K, d] (index_select: a row copy each way, unlike advanced indexing's
    backward, which sorts the indices)."""
    return x.index_select(0, rows.flatten()).view(*rows.shape, x.shape[-1])


def candidates(indexer: Indexer, qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, st: TopkBatchState
               ) -> Candidates:
    """Sel(t) by the inference path (per sequence), then the `recent` newest keys not already in it."""
    B, T = st.B, st.T
    t = torch.arange(T, device=qi.device)
    with torch.no_grad():
        sel = torch.cat([indexer.select(qi[b * T:(b + 1) * T].detach(), wi[b * T:(b + 1) * T].detach(),
                                        ki[b * T:(b + 1) * T].detach(), t) for b in range(B)])   # [B T, k']
        near = t[:, None] - torch.arange(st.recent, device=qi.device)                           # [T, W]
        near = near.repeat(B, 1)                                                                 # [B T, W]
        padded = sel.masked_fill(sel < 0, T)                 # ascending per row once -1 pads sort last
        at = torch.searchsorted(padded, near.clamp(min=0)).clamp(max=sel.shape[1] - 1)
        fresh = (near >= 0) & (padded.gather(1, at) != near)
        keys = torch.cat((sel, near), dim=1)                                                     # [B T, K]
        selected = torch.cat((sel >= 0, torch.zeros_like(fresh)), dim=1)
        scored = torch.cat((sel >= 0, fresh), dim=1)
        offset = (torch.arange(B * T, device=qi.device) // T * T)[:, None]
        rows = keys.clamp(min=0) + offset
    return Candidates(rows, selected, scored)


def indexer_kl(indexer: Indexer, qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, cand: Candidates,
               target: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(target || softmax of I over the scored candidates); I as spec §3.6."""
    dots = torch.einsum("nhd,nkd->nhk", qi, gather(ki, cand.rows)).relu()                    # [N, HI, K]
    scores = torch.einsum("nh,nhk->nk", indexer.head_weights(wi), dots).masked_fill(~cand.scored, float("-inf"))
    logq = torch.log_softmax(scores, dim=-1).masked_fill(~cand.scored, 0.0)
    return (torch.xlogy(target, target) - target * logq).sum(-1).mean()
