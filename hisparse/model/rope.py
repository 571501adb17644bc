"""Rotary embedding: YaRN frequency interpolation + LeRoPE learned per-pair scaling (spec §3.3).

Pairs are interleaved (u_{2j}, u_{2j+1}) for MLA; the indexer may use NeoX halves when
`indexer_rope_interleave` is false (spec §8 A5). Angles are computed in fp64, then cast.
"""

from __future__ import annotations

import functools
import math

import torch

from ..core.config import ModelConfig


def yarn_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """omega^Y_j for j in [0, dR/2), fp64: YaRN-interpolated RoPE frequencies (before LeRoPE)."""
    d, theta, yarn = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn
    j = torch.arange(d // 2, dtype=torch.float64)
    omega0 = theta ** (-2.0 * j / d)

    def corr(n: float) -> float:
        return d * math.log(yarn.original_max_position_embeddings / (2 * math.pi * n)) / (2 * math.log(theta))

    lo = max(math.floor(corr(yarn.beta)), 0)
    hi = min(math.ceil(corr(yarn.alpha)), d - 1)
    if lo == hi:
        hi += 0.001
    rho = ((j - lo) / (hi - lo)).clamp(0, 1)
    return (1 - rho) * omega0 + rho * omega0 / yarn.factor


@functools.lru_cache(maxsize=16)
def _yarn_on(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """yarn_frequencies(cfg) on `device`, made once: a forward then needs no host-to-device copy (which a CUDA
    graph could not capture)."""
    return yarn_frequencies(cfg).to(device)


def rope_frequencies(cfg: ModelConfig, lerope_alpha: torch.Tensor) -> torch.Tensor:
    """omega_j = omega^Y_j * exp(alpha_j) (LeRoPE: frequencies divided by exp(-alpha)), fp64 [dR/2]."""
    return _yarn_on(cfg, lerope_alpha.device) * torch.exp(lerope_alpha.detach().to(torch.float64))


def rope_cos_sin(omega: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of phi = p * omega, computed in fp64 then cast: [T, dR/2] each."""
    phi = positions.to(torch.float64)[:, None] * omega.to(positions.device)[None, :]
    return torch.cos(phi).to(dtype), torch.sin(phi).to(dtype)


def apply_rope(u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate the last dim of u [T, ..., dR] by position; cos/sin are [T, dR/2]."""
    shape = (cos.shape[0],) + (1,) * (u.dim() - 2) + (cos.shape[1],)
    c, s = cos.view(shape), sin.view(shape)
    if interleaved:
        a, b = u[..., 0::2], u[..., 1::2]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    half = u.shape[-1] // 2
    a, b = u[..., :half], u[..., half:]
    return torch.cat((a * c - b * s, a * s + b * c), dim=-1)


class LeRoPE(torch.nn.Module):
    """Learned per-pair frequency scaling `lerope.alpha` [dR/2] (global, or per layer when params say so)."""

    def __init__(self, rope_dim: int):
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.zeros(rope_dim // 2))
