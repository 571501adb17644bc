"""The frozen-haystack training forward: a few live tokens (a needle, the question, the answer) with autograd,
inserted into a long haystack whose hidden states were computed once, without gradients.

At a million tokens a `topk_forward` step costs ~40 CPU-minutes, nearly all of it Sel(t) of every haystack query
(quadratic), which the loss barely needs: what breaks a long answer is what the answer's queries select among a
million keys (docs/needle-model.md, "Beyond 128k"). Here the haystack's block inputs h_l are cached
(`cache_haystack`, one no-grad `topk_forward` pass) and each step runs only the live tokens through the layers. At
every layer the haystack rows' latents and indexer keys are recomputed from their cached h_l with the current
weights (so the key projections train on the far keys the answer's queries select), and the live queries select
and attend over the merged sequence, as `topk_forward` would over it.

Exact when the cache holds the hidden states of the merged sequence itself (the test does this). In training it
is an approximation: haystack rows after a needle keep the states and positions they had without it (the needle's
tokens share positions with the haystack rows that follow it), and the cache stays the one its round started with
while the weights move.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..model.ml4 import ML4, Block
from . import topk_forward
from .forward import block_forward, latents, queries, sequence_rope
from .topk_forward import QUERY_CHUNK, Candidates, TopkBatchState, sequence_candidates, sparse_attention


@dataclass
class HaystackCache:
    """A haystack's block inputs, computed once without gradients."""
    tokens: torch.Tensor            # [N]
    positions: torch.Tensor         # [N] each row's position (RoPE, as the live rows' are given)
    hidden: list[torch.Tensor]      # per layer: its block input h_l [N, D] (the residual stream)


def cache_haystack(model: ML4, tokens: torch.Tensor, recent: int, query_chunk: int = QUERY_CHUNK) -> HaystackCache:
    """tokens [N] -> every layer's block input over them (`topk_forward`'s math, no gradients, no head); a
    million tokens take minutes per layer, so a bar counts the layers."""
    with torch.no_grad():
        st = TopkBatchState(1, tokens.numel(), recent, query_chunk, *sequence_rope(model, tokens[None]))
        h = model.tok_embeddings(tokens)
        hidden = [h]
        for block in tqdm(model.layers[:-1], desc=f"cache {tokens.numel():,}-token haystack", unit="layer",
                          leave=False):
            h = block_forward(block, h, st, topk_forward.attention_forward)
            hidden.append(h)
    return HaystackCache(tokens, st.positions, hidden)


@dataclass
class PrefixState:
    """What the layers of one frozen-haystack forward share: the merged sequence (haystack rows and live rows in
    order) and the live rows' place in it."""
    cache: HaystackCache
    live: torch.Tensor              # [n] each live row's index in the merged sequence
    haystack: torch.Tensor          # [N] each haystack row's index in it
    positions: torch.Tensor         # [n] the live rows' positions
    cos: torch.Tensor               # [n, dR/2]
    sin: torch.Tensor
    all_cos: torch.Tensor           # [N + n, dR/2] every merged row's
    all_sin: torch.Tensor
    recent: int
    query_chunk: int
    layer: int = 0
    latents: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)  # merged rows
    candidates: dict[int, Candidates] = field(default_factory=dict)
    index_losses: list[torch.Tensor] = field(default_factory=list)


def prefix_forward(model: ML4, cache: HaystackCache, tokens: torch.Tensor, after: torch.Tensor,
                   positions: torch.Tensor, recent: int, query_chunk: int = QUERY_CHUNK
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Live tokens [n], each placed after the first after[j] haystack rows (non-decreasing; live rows with the
    same `after` keep their order) at positions [n] -> (their logits [n, V], each owner's indexer KL per live
    query [owners, n]), as `topk_forward` over the merged sequence gives at the live rows when the cache holds
    that sequence's haystack rows."""
    N, n = cache.tokens.numel(), tokens.numel()
    live = after + torch.arange(n, device=tokens.device)
    is_live = torch.zeros(N + n, dtype=torch.bool, device=tokens.device)
    is_live[live] = True
    haystack = (~is_live).nonzero()[:, 0]
    every = torch.empty(N + n, dtype=torch.long, device=tokens.device)    # the merged rows' positions
    every[live], every[haystack] = positions, cache.positions
    st = PrefixState(cache, live, haystack, positions, *model.rope(positions), *model.rope(every), recent,
                     query_chunk)
    h = model.tok_embeddings(tokens)                                                  # [n, D]
    for i, block in enumerate(model.layers):
        st.layer = i
        h = block_forward(block, h, st, attention_forward)
    return model.head(h), torch.stack(st.index_losses)


def attention_forward(block: Block, x: torch.Tensor, st: PrefixState) -> torch.Tensor:    # x [n, D] live rows
    mla, spec = block.attention, block.spec
    merged = merge(block.attention_norm(st.cache.hidden[st.layer]), x, st)             # [N + n, D]
    if spec.kv_owner:
        st.latents[spec.index] = latents(block, merged, st.all_cos, st.all_sin)
    q_nope, q_rope = queries(block, x, st.positions, st.cos, st.sin)
    c, k_rope = st.latents[spec.kv_source]
    index = None
    if mla.indexer is not None:
        qi, wi = mla.indexer.queries(x.detach(), st.positions, st.cos, st.sin)         # [n, HI, dI], [n, HI]
        ki = mla.indexer.keys(merged.detach(), st.all_cos, st.all_sin)                 # [N + n, dI]
        index = qi, ki, wi
        st.candidates[spec.index] = sequence_candidates(mla.indexer, qi, ki, wi, st.live, st.recent)
    return sparse_attention(block, q_nope, q_rope, c, k_rope, st.candidates[spec.index_source], index, st)


def merge(haystack: torch.Tensor, live: torch.Tensor, st: PrefixState) -> torch.Tensor:
    """Haystack rows [N, D] and live rows [n, D] -> the merged sequence's rows [N + n, D] (differentiable in
    both)."""
    out = haystack.new_zeros(haystack.shape[0] + live.shape[0], haystack.shape[1])
    return out.index_copy(0, st.haystack, haystack).index_copy(0, st.live, live)
