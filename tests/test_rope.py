"""YaRN + LeRoPE rotary embedding (ML4_SPEC §3.3, §9.5), checked against hand-derived numbers and a complex-number
rotation written here."""

from __future__ import annotations

import math

import pytest
import torch

from hisparse.core.config import ModelConfig, preset_params
from hisparse.model.rope import apply_rope, rope_cos_sin, rope_frequencies, yarn_frequencies


def config(name: str, **yarn) -> ModelConfig:
    p = preset_params(name)
    p["yarn"].update(yarn)
    return ModelConfig.from_params(p)


def plain_yarn(d: int, theta: float, f: float, lo: float, hi: float) -> torch.Tensor:
    """omega^Y_j with the ramp rho_j = clamp((j - lo) / (hi - lo), 0, 1) for given lo/hi."""
    j = torch.arange(d // 2, dtype=torch.float64)
    w0 = theta ** (-2 * j / d)
    rho = ((j - lo) / (hi - lo)).clamp(0, 1)
    return (1 - rho) * w0 + rho * w0 / f


def complex_rotate(u: torch.Tensor, p: torch.Tensor, omega: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """R(p) u for u [T, d] as multiplication of the pairs (as complex numbers) by e^{i p omega_j}."""
    d = u.shape[-1]
    z = torch.complex(u[:, 0::2], u[:, 1::2]) if interleaved else torch.complex(u[:, : d // 2], u[:, d // 2:])
    z = z * torch.exp(1j * p.double()[:, None] * omega[None, :])
    return torch.stack((z.real, z.imag), -1).flatten(1) if interleaved else torch.cat((z.real, z.imag), 1)


def rope(u: torch.Tensor, p: torch.Tensor, omega: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    cos, sin = rope_cos_sin(omega, p, u.dtype)
    return apply_rope(u, cos, sin, interleaved)


@pytest.mark.parametrize("name,lo,hi,rho", [
    ("tiny", 0, 2, [0.0, 0.5, 1.0, 1.0]),                                   # §1.2: lo = 0, hi = 2
    ("full", 3, 16, [min(max((j - 3) / 13, 0.0), 1.0) for j in range(32)]),  # §3.3: corr 3.25 / 15.29 -> 3, 16
])
def test_alpha_zero_is_plain_yarn(name: str, lo: int, hi: int, rho: list[float]) -> None:
    cfg = config(name)
    d, f = cfg.qk_rope_head_dim, cfg.yarn.factor
    omega = rope_frequencies(cfg, torch.zeros(d // 2))
    torch.testing.assert_close(omega, plain_yarn(d, 1e4, f, lo, hi), rtol=1e-15, atol=0)
    w0 = 1e4 ** (-2 * torch.arange(d // 2, dtype=torch.float64) / d)
    expected = torch.tensor([(1 - r) * w + r * w / f for r, w in zip(rho, w0.tolist())], dtype=torch.float64)
    torch.testing.assert_close(omega, expected, rtol=1e-14, atol=0)
    # all three regimes occur: kept (fast dims), interpolated, divided by f
    ratio = omega / w0
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(1 / f) and ((ratio < 1) & (ratio > 1 / f)).any()


def test_corr_numbers() -> None:
    """The spec's corr values: full 3.25 / 15.29 (beta_fast 32 / beta_slow 1), tiny < 0 / 1.008."""
    def corr(d: int, L0: int, n: float) -> float:
        return d * math.log(L0 / (2 * math.pi * n)) / (2 * math.log(1e4))
    assert corr(64, 512, 32) == pytest.approx(3.25, abs=0.01) and corr(64, 512, 1) == pytest.approx(15.29, abs=0.01)
    assert corr(8, 64, 32) < 0 and 1 < corr(8, 64, 1) < 2


def test_lerope_multiplies_by_exp_alpha() -> None:
    """omega_j = omega^Y_j / exp(-alpha_j)."""
    cfg = config("tiny")
    alpha = torch.randn(4, dtype=torch.float64) * 0.3
    torch.testing.assert_close(rope_frequencies(cfg, alpha), yarn_frequencies(cfg) / torch.exp(-alpha))


def test_factor_one_alpha_zero_is_plain_rope() -> None:
    """f = 1, alpha = 0: omega_j = 1e4^(-2j/d); the rotation equals the complex-number RoPE."""
    for name in ("tiny", "full"):
        cfg = config(name, factor=1)
        d = cfg.qk_rope_head_dim
        omega = rope_frequencies(cfg, torch.zeros(d // 2))
        torch.testing.assert_close(omega, 1e4 ** (-2 * torch.arange(d // 2, dtype=torch.float64) / d),
                                   rtol=1e-15, atol=0)
        g = torch.Generator().manual_seed(d)
        u = torch.randn(20, d, dtype=torch.float64, generator=g)
        p = torch.randint(0, 100000, (20,), generator=g)
        torch.testing.assert_close(rope(u, p, omega), complex_rotate(u, p, omega), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("interleaved", [True, False])
def test_pairs_rotate(interleaved: bool) -> None:
    """Interleaved: pair j is (u_2j, u_2j+1); NeoX (indexer option): (u_j, u_j+d/2). Checked one pair at a time."""
    d = 8
    omega = torch.tensor([0.3, 0.7, 1.1, 1.9], dtype=torch.float64)
    p = torch.tensor([5])
    for j in range(d // 2):
        a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + d // 2)
        u = torch.zeros(1, d, dtype=torch.float64)
        u[0, a], u[0, b] = 1.0, 2.0
        out = rope(u, p, omega, interleaved)
        phi = 5 * float(omega[j])
        expect = torch.zeros(1, d, dtype=torch.float64)
        expect[0, a] = math.cos(phi) - 2 * math.sin(phi)
        expect[0, b] = math.sin(phi) + 2 * math.cos(phi)
        torch.testing.assert_close(out, expect, rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("interleaved", [True, False])
def test_norm_preserved_and_relative_position(dtype: torch.dtype, interleaved: bool, seed: int) -> None:
    """|R(p)u| = |u| and <R(p)q, R(s)k> depends on p - s only (far positions: angles computed in fp64)."""
    cfg = config("full")
    g = torch.Generator().manual_seed(seed)
    alpha = torch.randn(32, generator=g, dtype=torch.float64) * 0.1
    omega = rope_frequencies(cfg, alpha)
    q = torch.randn(1, 64, generator=g, dtype=dtype)
    k = torch.randn(1, 64, generator=g, dtype=dtype)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    base = int(torch.randint(0, 1 << 20, (1,), generator=g))
    for p in (0, 7, base, (1 << 20) - 1):
        out = rope(q, torch.tensor([p]), omega, interleaved)
        assert abs(float(out.norm() / q.norm()) - 1) < tol
    dots = []
    for shift in (0, 1000, base):
        p, s = torch.tensor([shift + 37]), torch.tensor([shift])
        dots.append(float((rope(q, p, omega, interleaved) * rope(k, s, omega, interleaved)).sum()))
    scale = float(q.norm() * k.norm())
    assert max(dots) - min(dots) < 10 * tol * scale
    # and it does depend on p - s: <R(p)q, R(s)q> = sum_j |q_j|^2 cos((p - s) w_j) is |q|^2 only at p == s (a
    # random k could give equal dots at two offsets by chance)
    same = float((rope(q, torch.tensor([3]), omega, interleaved) * rope(q, torch.tensor([3]), omega,
                                                                       interleaved)).sum())
    moved = float((rope(q, torch.tensor([40]), omega, interleaved) * rope(q, torch.tensor([0]), omega,
                                                                         interleaved)).sum())
    assert abs(same - float(q.norm()) ** 2) < 10 * tol * float(q.norm()) ** 2
    assert float(q.norm()) ** 2 - moved > 1e-2 * float(q.norm()) ** 2


def test_rotation_batched_over_heads() -> None:
    """u [T, H, d]: every head of token t rotates by position p_t."""
    omega = rope_frequencies(config("tiny"), torch.zeros(4))
    u = torch.randn(6, 3, 8, dtype=torch.float64)
    p = torch.arange(6) * 11
    out = rope(u, p, omega)
    for h in range(3):
        torch.testing.assert_close(out[:, h], complex_rotate(u[:, h], p, omega))
