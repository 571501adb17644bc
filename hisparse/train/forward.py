"""The training forward: ML4's own modules over full sequences, with autograd, dense or top-k sparse.

Inference (`ML4.forward`) runs absorbed MLA over rows a LatentKV returns, without gradients. Training runs the
same parameters in the naive form of spec §3.7 (k_N = W_UK c, v = W_UV c; identical in exact arithmetic) over a
batch of equal-length sequences [B, T], every query against every earlier key:

* dense: causal softmax attention (the indexers are trained, not used);
* sparse: each query attends only to its layer's Sel(t), the exact stable top-k of its indexer's scores
  (`select_topk`, ties to the earlier position, as at inference); sharers reuse their owner's selection.

Indexer loss (DeepSeek-V3.2's warm-up objective): KL(p_t || softmax_s I[t, s]), p_t the layer's dense attention
distribution averaged over heads, detached; the indexer reads a detached input, so its loss trains only the
indexer. In the sparse stage p_t still comes from the dense scores (computed without gradient), so a relevant key
the indexer missed keeps pulling it up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..kv.scoring import select_topk
from ..model.indexer import ssmax_gain
from ..model.ml4 import ML4, Block
from ..model.rope import apply_rope


@dataclass
class TrainBatchState:
    """What the layers of one training forward share."""
    B: int
    T: int
    positions: torch.Tensor                 # [B T] (the sequence positions, repeated per sequence)
    cos: torch.Tensor                       # [B T, dR/2]
    sin: torch.Tensor
    causal: torch.Tensor                    # [T, T] bool, key s visible to query t
    topk: int | None                        # None: dense attention
    latents: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)  # c, k_rope
    masks: dict[int, torch.Tensor] = field(default_factory=dict)         # owner layer -> [B, T, T] selected
    index_losses: list[torch.Tensor] = field(default_factory=list)


def train_forward(model: ML4, tokens: torch.Tensor, topk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> (logits [B T, V], mean indexer KL over the owning layers)."""
    B, T = tokens.shape
    pos, cos, sin = sequence_rope(model, tokens)
    causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
    st = TrainBatchState(B, T, pos, cos, sin, causal, topk)
    return layers_forward(model, tokens, st, attention_forward), torch.stack(st.index_losses).mean()


def sequence_rope(model: ML4, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> positions [B T] (0..T-1 per sequence) and their RoPE cos, sin [B T, dR/2]."""
    if model.cfg.lerope_per_layer:
        raise ValueError("lerope.per_layer: training supports the global LeRoPE only")
    B, T = tokens.shape
    pos = torch.arange(T, device=tokens.device).repeat(B)
    return pos, *model.rope(pos)


def layers_forward(model: ML4, tokens: torch.Tensor, st, attention: Callable) -> torch.Tensor:
    """Embeddings, every block (its attention by `attention(block, x, st)`, then its FFN) and the head:
    tokens [B, T] -> logits [B T, V]."""
    h = model.tok_embeddings(tokens).flatten(0, 1)                                    # [B T, D]
    for block in model.layers:
        h = block_forward(block, h, st, attention)
    return model.head(h)


def block_forward(block: Block, h: torch.Tensor, st, attention: Callable) -> torch.Tensor:
    """One block on the residual stream h [N, D]: its attention by `attention(block, x, st)`, then its FFN."""
    h = h + attention(block, block.attention_norm(h), st)
    ffn = block.feed_forward if block.spec.ffn == "dense" else block.moe
    return h + ffn(block.ffn_norm(h))


def queries_and_latents(block: Block, x: torch.Tensor, st) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, D] -> q_nope [N, H, dN], q_rope [N, H, dR] (None on NoPE layers), SSMax gain applied; a KV owner
    also stores its latents c [N, r] and k_rope [N, dR] in st.latents (st: either forward's batch state)."""
    if block.spec.kv_owner:
        st.latents[block.spec.index] = latents(block, x, st.cos, st.sin)
    return queries(block, x, st.positions, st.cos, st.sin)


def queries(block: Block, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, D] at `positions` -> q_nope [N, H, dN], q_rope [N, H, dR] (None on NoPE layers), SSMax gain
    applied."""
    mla, spec, cfg = block.attention, block.spec, block.attention.cfg
    dN = cfg.qk_nope_head_dim
    q = mla.wq(x).view(x.shape[0], cfg.n_heads, mla.q_head_dim)
    q_nope, q_rope = q[..., :dN], (apply_rope(q[..., dN:], cos, sin) if spec.rope else None)
    if mla.ssmax_scaling is not None:
        g = ssmax_gain(mla.ssmax_scaling, positions, x.dtype)[..., None]             # [N, H, 1]
        q_nope, q_rope = q_nope * g, (q_rope * g if q_rope is not None else None)
    return q_nope, q_rope


def latents(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A KV owner's rows of x [N, D]: latents c [N, r] and k_rope [N, dR] (None on NoPE layers)."""
    mla, r = block.attention, block.attention.cfg.kv_lora_rank
    a = mla.wkv_a_with_mqa(x)
    return mla.kv_a_norm(a[:, :r]), (apply_rope(a[:, r:], cos, sin) if block.spec.rope else None)


def attention_forward(block: Block, x: torch.Tensor, st: TrainBatchState) -> torch.Tensor:   # x [B T, D]
    mla, spec, cfg = block.attention, block.spec, block.attention.cfg
    B, T, H, dN, r = st.B, st.T, cfg.n_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    q_nope, q_rope = queries_and_latents(block, x, st)
    c, k_rope = st.latents[spec.kv_source]                                          # [B T, r], [B T, dR]
    w_kvb = mla.wkv_b.weight.view(H, dN + cfg.v_head_dim, r)
    k_nope = torch.einsum("nc,hdc->hnd", c, w_kvb[:, :dN]).unflatten(1, (B, T)).transpose(0, 1)   # [B, H, T, dN]
    v = torch.einsum("nc,hdc->hnd", c, w_kvb[:, dN:]).unflatten(1, (B, T)).transpose(0, 1)        # [B, H, T, dV]
    logits = q_nope.view(B, T, H, dN).transpose(1, 2) @ k_nope.transpose(-1, -2)                   # [B, H, T, T]
    if q_rope is not None:
        logits = logits + q_rope.view(B, T, H, -1).transpose(1, 2) @ k_rope.view(B, 1, T, -1).transpose(-1, -2)
    logits = (logits * mla.scale).masked_fill(~st.causal, float("-inf"))
    if mla.indexer is not None:
        with torch.no_grad():
            target = torch.softmax(logits, dim=-1).mean(dim=1)                          # [B, T, T] p_t
        st.masks[spec.index] = indexer_forward(mla.indexer, x.detach(), target, st)
    if st.topk is not None:
        logits = logits.masked_fill(~st.masks[spec.index_source][:, None], float("-inf"))
    o = torch.softmax(logits, dim=-1) @ v                                                           # [B, H, T, dV]
    return mla.wo(o.transpose(1, 2).reshape(B * T, -1))


def indexer_forward(indexer, x: torch.Tensor, target: torch.Tensor, st: TrainBatchState) -> torch.Tensor:
    """Adds this owner's KL loss to `st`; returns its selection mask [B, T, T] (all visible keys when dense)."""
    B, T = st.B, st.T
    q, k, w = indexer.project(x, st.positions, st.cos, st.sin)                     # [B T, HI, dI], [B T, dI]
    wr = indexer.head_weights(w).view(B, T, -1)                                     # [B, T, HI]
    dots = torch.einsum("bthd,bsd->bths", q.view(B, T, *q.shape[1:]), k.view(B, T, -1)).relu()
    scores = torch.einsum("bth,bths->bts", wr, dots).masked_fill(~st.causal, float("-inf"))   # I [B, T, T]
    logq = torch.log_softmax(scores, dim=-1).masked_fill(~st.causal, 0.0)
    st.index_losses.append((torch.xlogy(target, target) - target * logq).sum(-1).mean())
    if st.topk is None or T <= st.topk:
        return st.causal.expand(B, T, T)
    sel = select_topk(scores.detach().flatten(0, 1), st.topk)                       # [B T, k], -1 padded
    row, slot = (sel >= 0).nonzero(as_tuple=True)
    mask = torch.zeros(B * T, T, dtype=torch.bool, device=x.device)
    mask[row, sel[row, slot]] = True
    return mask.view(B, T, T)
