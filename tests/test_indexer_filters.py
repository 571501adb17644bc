"""The indexer kernel's bf16 and int8 filters (AMX tiles, the dot filters) against the torch path: every shape they
take, and for each part of their error bounds (filter_slack in indexer_topk.cpp) a near-tie case that fails
without it; and which builds run which filter on this CPU."""

from __future__ import annotations

import pytest
import torch

from hisparse.kv.kernels.indexer_topk import (DOT_BF16_FILTER, FMA_FILTER, Build, full_row_filter, fused_topk, has_amx,
                                              has_dot, has_dot_int8)
from test_indexer_kernel import DOT_ALL, DOT_BF16_ALL, random_case, torch_topk

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("HI", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("kind", ["normal", "near", "dup", "near-bf16-q", "near-bf16-keys"])
def test_tile_filter_shapes(seed: int, HI: int, kind: str) -> None:
    """The AMX filter's shapes: 32 / HI rows per pass (or HI / 16 tiles per row), dI padded to whole 32-wide tile
    columns (one or several), the last group of a row tile partly empty, rows whose heaps fill inside the
    scan, causal limits inside a block. Near ties with queries or keys exact in bf16 leave one rounding residual
    alone in the filter's error (the keys', the queries'), so its bound must count each. Selections and scores
    are the torch path's."""
    g = torch.Generator().manual_seed(seed)
    for dI in (1, 31, 32, 33, 64, 128):
        T, S = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(300, 3000, (1,), generator=g))
        k = int(torch.randint(1, 80, (1,), generator=g))
        q, wr, keys, n_visible = random_case(g, torch.float32, kind.removesuffix("-bf16-q").removesuffix("-bf16-keys"),
                                             T, S, HI, dI)
        if kind.endswith("-bf16-q"):
            q = q.bfloat16().float()
        elif kind.endswith("-bf16-keys"):   # near-duplicates of bf16 values, so the keys' residuals are small
            keys = keys.bfloat16().float() * (1 + torch.randint(-2, 3, keys.shape, generator=g) * 2.0 ** -23)
        cols, scores = fused_topk(q, wr, keys, n_visible, k, with_scores=True)
        want_cols, want_scores = torch_topk(q, wr, keys, n_visible, k)
        case = f"T={T} S={S} HI={HI} dI={dI} k={k}"
        assert torch.equal(cols, want_cols), case
        assert torch.equal(scores, want_scores), case


def test_tile_filter_is_used_exactly_where_the_cpu_has_it() -> None:
    """The default build filters with AMX tiles on a CPU that has them (so the tests above run that path) and not
    on one without; the builds without the tile filter never use it. Without /proc/cpuinfo (not Linux) the kernel
    is built without tiles (it asks Linux for the tile state), so it must not report them."""
    flags = cpu_flags()
    assert has_amx() == ("amx_bf16" in flags and "avx512f" in flags)
    assert not has_amx(Build(amx=False)) and not has_amx(Build(filter=False))


def cpu_flags() -> list[str]:
    """The CPU's feature flags (none without /proc/cpuinfo, as on other systems than Linux)."""
    try:
        return next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return []


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def bf16_case(g: torch.Generator, kind: str, T: int, S: int, HI: int, dI: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 inputs for the bf16 filters (random_case's kinds, and): one for each part of their error bound
    (filter_slack in indexer_topk.cpp), in which that part is all or most of the error near the threshold, so that
    the part's absence makes the kernel select otherwise than the torch path:
    'near-bf16-q' (near ties, q exact in bf16: the keys' rounding residual), 'near-bf16-keys' (near ties, keys
    ulps from bf16 values: the queries' residual), 'exact-bf16' (q, keys in bf16, so products are exact; real
    ties whose fp32 sums, taken in another order, are ulps apart: the fp32 sums), 'tiny-q' / 'tiny-keys' (q or
    keys partly denormal in bf16, which the filter takes as 0), 'underflow' (normal bf16 inputs with denormal
    products, which it flushes) and 'tiny-w' (denormal scores: the exact path's underflow)."""
    if kind in ("normal", "near", "dup"):
        return random_case(g, torch.float32, kind, T, S, HI, dI)
    if kind in ("near-bf16-q", "near-bf16-keys"):
        q, wr, keys, n_visible = random_case(g, torch.float32, "near", T, S, HI, dI)
        if kind == "near-bf16-q":
            return bf16(q), wr, keys, n_visible
        return q, wr, bf16(keys) * (1 + torch.randint(-2, 3, keys.shape, generator=g) * 2.0 ** -23), n_visible
    q, wr, keys, n_visible = random_case(g, torch.float32, "normal", T, S, HI, dI)
    if kind == "exact-bf16":   # q equal on dims d and d + dI // 2, keys with those two dims swapped at random
        h = dI // 2
        scale = 2.0 ** torch.randint(-10, 11, (dI,), generator=g)   # magnitudes apart: cancelling sums
        keys = bf16(keys * scale)[torch.randint(0, max(1, S // 16), (S,), generator=g)]
        q = bf16(q * scale)
        q[:, :, h:2 * h] = q[:, :, :h]
        swap = torch.rand(S, h, generator=g) < 0.5
        a, b = keys[:, :h].clone(), keys[:, h:2 * h].clone()
        keys[:, :h], keys[:, h:2 * h] = torch.where(swap, b, a), torch.where(swap, a, b)
        return q, wr.abs(), keys, n_visible
    if kind == "tiny-q":       # keys large, so that the dropped products count
        return bf16(q * 2.0 ** -124), wr, bf16(keys * 2.0 ** 20), n_visible
    if kind == "tiny-keys":
        return bf16(q * 2.0 ** 20), wr, bf16(keys * 2.0 ** -124), n_visible
    if kind == "underflow":
        return bf16(q * 2.0 ** -63), wr, bf16(keys * 2.0 ** -63), n_visible
    if kind == "tiny-w":       # head weights of a few 2^-149 and dots multiples of 1/2: a head's term is often half
        q, keys = (q * 1.5).round() / 2, (keys * 1.5).round()   # a denormal step, which an FMA rounds otherwise
        return q, (wr * 2).round() * 2.0 ** -149, keys, n_visible
    raise ValueError(kind)


BF16_KINDS = ["normal", "near", "dup", "near-bf16-q", "near-bf16-keys", "exact-bf16", "tiny-q", "tiny-keys",
              "underflow", "tiny-w"]


def int8_exact(g: torch.Generator, x: torch.Tensor, one_scale: bool = False) -> torch.Tensor:
    """x rounded to multiples of one power of two s per row (last dim; or for all rows), each row with an entry
    of +-127 s: the int8 dot filter's scale of such rows is s and their rounding residual 0."""
    m = x.abs().amax() if one_scale else x.abs().amax(-1, keepdim=True)
    s = 2.0 ** torch.ceil(torch.log2(m.clamp(min=1e-30) / 127))
    out = (x / s).round().clamp(-127, 127)
    idx = torch.randint(0, x.shape[-1], x.shape[:-1] + (1,), generator=g)
    return out.scatter(-1, idx, 127.0) * s


def int8_case(g: torch.Generator, kind: str, T: int, S: int, HI: int, dI: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 inputs aimed at the int8 dot filter's error bound (filter_slack): 'near-int8-q' (near ties, q exact
    in int8 per head: the keys' residual is the whole error) and 'near-int8-keys' (near ties, keys ulps from int8
    values on one scale: the queries' residual is most of it)."""
    q, wr, keys, n_visible = random_case(g, torch.float32, "near", T, S, HI, dI)
    if kind == "near-int8-q":
        return int8_exact(g, q), wr, keys, n_visible
    keys = int8_exact(g, keys, one_scale=True)   # every block's scale is s
    return q, wr, keys * (1 + torch.randint(-2, 3, keys.shape, generator=g) * 2.0 ** -23), n_visible


DOT_CASES = [(DOT_ALL, kind) for kind in BF16_KINDS + ["near-int8-q", "near-int8-keys"]] + \
    [(DOT_BF16_ALL, kind) for kind in BF16_KINDS]


@pytest.mark.parametrize("HI", [1, 2, 3, 4, 5, 8, 16, 32])
@pytest.mark.parametrize("build,kind", DOT_CASES,
                         ids=[f"{'int8' if b.dot_int8 else 'bf16'}-{kind}" for b, kind in DOT_CASES])
def test_dot_filter_shapes(seed: int, HI: int, build: Build, kind: str) -> None:
    """The dot filter, int8 and bf16 (every shape takes it in DOT_ALL / DOT_BF16_ALL): any head count (up to 4
    heads a pass, the positive heads first), odd and even dI (words zero-padded), 1 to 128, the last group of a row
    partly empty, heaps that fill inside a block, causal limits inside a block, and a near-tie case for each part
    of its error bound (bf16_case, int8_case). Selections and scores are the torch path's; the default build
    (which takes the filter from HI x dI = 32) too."""
    if not has_dot(build) or has_dot_int8(build) != build.dot_int8:
        pytest.skip(f"the CPU has no {'AVX512_VNNI' if build.dot_int8 else 'AVX512_BF16'} (or AVX-512), so the "
                    "kernel is built without this dot filter")
    g = torch.Generator().manual_seed(seed)
    for dI in (1, 2, 3, 16, 31, 32, 33, 64, 128):
        T, S = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(300, 3000, (1,), generator=g))
        k = int(torch.randint(1, 80, (1,), generator=g))
        case_of = int8_case if "int8" in kind else bf16_case
        q, wr, keys, n_visible = case_of(g, kind, T, S, HI, dI)
        want_cols, want_scores = torch_topk(q, wr, keys, n_visible, k)
        for build in (build, Build()) if HI * dI >= 32 else (build,):
            cols, scores = fused_topk(q, wr, keys, n_visible, k, with_scores=True, build=build)
            case = f"T={T} S={S} HI={HI} dI={dI} k={k} {build}"
            assert torch.equal(cols, want_cols), case
            assert torch.equal(scores, want_scores), case


def test_dot_filter_is_used_exactly_where_the_cpu_has_it() -> None:
    """Builds with AVX-512 lanes and filters have the dot filter on a CPU with AVX512_VNNI or AVX512_BF16 (so the
    tests above run it), int8 where it has AVX512_VNNI unless the build asks for bf16, and none on other CPUs;
    builds without it, filters or 512-bit lanes never do."""
    flags = cpu_flags()
    avx512, vnni, bf16_ = "avx512f" in flags, "avx512_vnni" in flags, "avx512_bf16" in flags
    assert has_dot(Build(amx=False)) == has_dot() == (avx512 and (vnni or bf16_))
    assert has_dot_int8() == has_dot_int8(Build(amx=False)) == (avx512 and vnni)
    assert has_dot(Build(dot_int8=False)) == (avx512 and bf16_) and not has_dot_int8(Build(dot_int8=False))
    assert not has_dot(Build(dot=False)) and not has_dot(Build(filter=False))
    assert not has_dot(Build(vec_bytes=32))
    dot = "dot_int8" if avx512 and vnni else "dot_bf16" if avx512 and bf16_ else "fma"
    assert full_row_filter(Build(amx=False)) == dot
    assert full_row_filter(DOT_BF16_FILTER) == ("dot_bf16" if avx512 and bf16_ else "fma")
    assert full_row_filter(FMA_FILTER) == "fma" and full_row_filter(Build(filter=False)) == "none"
    assert full_row_filter() == ("amx" if has_amx() else dot)
