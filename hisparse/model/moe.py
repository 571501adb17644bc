"""Feed-forward blocks: SwiGLU (dense layer 0, experts) and the softmax-routed MoE (spec §3.8).

The routed experts run one of two ways (`MoE.kernels`): the torch path, one SwiGLU per expert over its tokens
(reads the per-expert counts on the host), or two grouped GEMMs over all experts (Triton, kernels/moe_triton.py:
static shapes, no host synchronisation). "auto" takes Triton for CUDA activations when it is installed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..core import triton_support
from ..core.config import ModelConfig
from .linear import Linear

if TYPE_CHECKING:
    from .kernels.moe_triton import StackedExperts


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
        self.kernels = "auto"     # "auto" | "triton" | "torch" (the --kernels setting; see the module docstring)
        self._stacked = None      # the local experts' weights stacked for the grouped kernels (built on first use)

    def forward(self, y: torch.Tensor) -> torch.Tensor:   # y [N, D]
        logits = F.linear(y.to(self.gate.weight.dtype), self.gate.weight)   # fp32 (or fp64 in tests) router
        ids, gates = route(logits, self.top_k)                               # [N, k], [N, k]
        routed = self.grouped(y, ids, gates) if self._use_triton(y) else self.per_expert(y, ids, gates)
        return self.routed_scale * routed + self.shared_experts(y)

    def _use_triton(self, y: torch.Tensor) -> bool:
        if self.kernels == "torch" or y.dtype == torch.float64:   # fp64: the exactness reference, torch only
            return False
        return self.kernels == "triton" or (y.is_cuda and triton_support.available())

    def grouped(self, y: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """The local experts' weighted sum as two grouped GEMMs (Triton): [N, D]."""
        from .kernels.moe_triton import grouped_experts
        return grouped_experts(y, ids, gates, self.stacked(), self.local_experts.start)

    def stacked(self) -> StackedExperts:
        """The local experts' w1/w3/w2 (and FP8 block scales) stacked [E, out, in]; the experts' parameters become
        views of the stacks, so the weights stay in memory once."""
        if self._stacked is None:
            from .kernels.moe_triton import StackedExperts
            experts = [self.experts[e] for e in self.local_experts]
            names, attrs = ("w1", "w3", "w2"), ("weight", "weight_scale") if experts[0].w1.fp8 else ("weight",)
            stacks = {(n, a): torch.stack([getattr(getattr(x, n), a) for x in experts]) for n in names for a in attrs}
            for i, x in enumerate(experts):
                for (n, a), st in stacks.items():
                    setattr(getattr(x, n), a, nn.Parameter(st[i], requires_grad=False))
            scales = tuple(stacks[(n, "weight_scale")] for n in names) if len(attrs) == 2 else None
            self._stacked = StackedExperts(*(stacks[(n, "weight")] for n in names), scales, experts[0].w1.block)
        return self._stacked

    def per_expert(self, y: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """The local experts' weighted sum, one SwiGLU per expert over the tokens routed to it: [N, D]."""
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
        return out
