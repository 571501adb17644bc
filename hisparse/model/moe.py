"""Feed-forward blocks: SwiGLU (dense layer 0, experts) and the softmax-routed MoE (spec §3.8)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .linear import Linear


class SwiGLU(nn.Module):
    """w2 (silu(w1 y) * w3 y); w1 = gate, w3 = up, w2 = down."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = Linear(dim, hidden, bias=False)
        self.w2 = Linear(hidden, dim, bias=False)
        self.w3 = Linear(dim, hidden, bias=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(y)) * self.w3(y))


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router, top-k (ties: lower expert id), gates renormalised over the top-k.

    router_logits [N, E] -> (expert ids [N, k], gates [N, k], rows sum to 1).
    """
    probs = torch.softmax(router_logits, dim=-1)
    vals, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    vals, ids = vals[:, :top_k], ids[:, :top_k]
    return ids, vals / vals.sum(-1, keepdim=True)


class MoE(nn.Module):
    """Routed experts + shared expert. Checkpoint names sit directly under `layers.N.` (see weights.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.top_k, self.routed_scale = m.num_experts_per_tok, m.routed_scale
        self.gate = Linear(cfg.dim, m.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.dim, m.expert_hidden_dim) for _ in range(m.num_experts))
        self.local_experts = range(m.num_experts)   # the experts this module computes (the others are None: an
                                                    # expert-parallel rank holds num_experts / EP of them)
        self.shared_experts = SwiGLU(cfg.dim, m.expert_hidden_dim * m.num_shared_experts)

    def forward(self, y: torch.Tensor) -> torch.Tensor:   # y [N, D]
        logits = F.linear(y.to(self.gate.weight.dtype), self.gate.weight)   # fp32 (or fp64 in tests) router
        ids, gates = route(logits, self.top_k)                               # [N, k], [N, k]
        out = torch.zeros_like(y)
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        token_of = order // self.top_k
        gate_of = gates.flatten()[order].to(y.dtype)
        start = sum(counts[:self.local_experts.start])
        for e in self.local_experts:   # one batched SwiGLU per expert, over the tokens routed to it
            n = counts[e]
            if n:
                tok = token_of[start:start + n]
                out.index_add_(0, tok, self.experts[e](y[tok]) * gate_of[start:start + n, None])
                start += n
        return self.routed_scale * out + self.shared_experts(y)
