"""Linear layers in checkpoint precision: a plain weight, or an FP8 e4m3 weight with B0 x B1 block scales (§2.2).

An FP8 `Linear` keeps `weight` [out, in] in e4m3 and `weight_scale` [ceil(out/B0), ceil(in/B1)] in fp32, as the
checkpoint stores them; W[i, j] = float(W8[i, j]) * S[i // B0, j // B1]. Its matmul never holds a dequantised
copy of the whole weight: with bf16 activations on CUDA it is `torch._scaled_mm` with 1 x B1 activation groups and
B0 x B1 weight blocks (Hopper's blockwise FP8 GEMM, as DeepSeek-V3.2's `fp8_gemm`); otherwise (CPU, fp32/fp64
exactness runs, a GPU without the blockwise GEMM) it dequantises a tile of whole block rows at a time, at most
DEQUANT_TILE_ELEMS weight elements, and multiplies by it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
DEQUANT_TILE_ELEMS = 1 << 22   # weight elements one dequantised tile holds (16 MiB in fp32): bounds the transient


def weight_dequant(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W8 [out, in] e4m3, scale [ceil(out/B0), ceil(in/B1)] -> W [out, in] in `dtype` (edge blocks partial).

    The product is taken in fp32 (fp64 for fp64): w8.to(acc) * scale per block, then cast to `dtype`."""
    acc = torch.promote_types(dtype, torch.float32)
    out, inp = w8.shape
    s = scale.to(acc).repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return (w8.to(acc) * s).to(dtype)


def weight_quant(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled e4m3 (scale = block amax / 448) -> (W8, scale); the inverse of weight_dequant."""
    out, inp = w.shape
    b0, b1 = block
    pad = torch.zeros(-(-out // b0) * b0, -(-inp // b1) * b1, dtype=torch.float32)
    pad[:out, :inp] = w.float()
    tiles = pad.view(pad.shape[0] // b0, b0, pad.shape[1] // b1, b1)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    w8 = (tiles / scale[:, None, :, None]).view_as(pad)[:out, :inp].to(FP8)
    return w8, scale


def tiled_fp8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [..., in] @ W^T -> [..., out] in x's dtype, dequantising whole block rows of W a tile at a time."""
    out, inp = w8.shape
    b0 = block[0]
    rows = max(b0, DEQUANT_TILE_ELEMS // max(1, inp) // b0 * b0)
    if rows >= out:
        return F.linear(x, weight_dequant(w8, scale, block, x.dtype))
    y = x.new_empty(*x.shape[:-1], out)
    for r in range(0, out, rows):   # out / rows tiles: a handful even at full size
        w = weight_dequant(w8[r:r + rows], scale[r // b0: -(-(r + rows) // b0)], block, x.dtype)
        y[..., r:r + rows] = F.linear(x, w)
    return y


def act_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % group == 0) -> e4m3 [M, K] and fp32 scales [M, K / group], one per 1 x group slice."""
    g = x.float().unflatten(-1, (-1, group))
    s = (g.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (g / s[..., None]).to(FP8).flatten(-2), s


def scaled_mm_fp8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                         block: tuple[int, int]) -> torch.Tensor:
    """x [..., in] bf16 @ W^T on CUDA with the blockwise FP8 GEMM (activations quantised per 1 x B1 group)."""
    x2 = x.reshape(-1, x.shape[-1])
    x8, sx = act_quant(x2, block[1])
    # scale layouts the blockwise kernel expects: activation scales outer-dim-major, weight scales as stored
    y = torch._scaled_mm(x8, w8.t(), scale_a=sx.t().contiguous().t(), scale_b=scale.t(), out_dtype=torch.bfloat16)
    return y.view(*x.shape[:-1], w8.shape[0])


_SCALED_MM_OK: dict[torch.device, bool] = {}


def blockwise_scaled_mm_ok(device: torch.device, block: tuple[int, int]) -> bool:
    """Whether this CUDA device runs the blockwise FP8 GEMM correctly: probed once per device on a small product
    against the dequantised reference; on failure fp8 linears use the tiled dequantise path."""
    if device.type != "cuda" or tuple(block) != (128, 128):
        return False
    if device not in _SCALED_MM_OK:
        g = torch.Generator().manual_seed(0)   # a private generator: the probe leaves the global RNG alone
        w8, s = weight_quant(torch.randn(256, 256, generator=g), (128, 128))
        w8, s, x = w8.to(device), s.to(device), torch.randn(16, 256, generator=g).bfloat16().to(device)
        try:
            got = scaled_mm_fp8_linear(x, w8, s, (128, 128)).float()
            ref = F.linear(x.float(), weight_dequant(w8, s, (128, 128)))
            _SCALED_MM_OK[device] = bool(((got - ref).norm() / ref.norm()) < 0.05)
        except (RuntimeError, NotImplementedError):
            _SCALED_MM_OK[device] = False
    return _SCALED_MM_OK[device]


class Linear(nn.Linear):
    """y = x W^T (+ b) with `weight` in checkpoint precision: plain (bf16/fp32/fp64), or FP8 e4m3 with
    `weight_scale` [ceil(out/B0), ceil(in/B1)] fp32 after `to_fp8` (the loader calls it for tensors stored so)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.register_parameter("weight_scale", None)
        self.block: tuple[int, int] | None = None

    @property
    def fp8(self) -> bool:
        return self.weight_scale is not None

    def to_fp8(self, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
        """Hold W8 [out, in] e4m3 and its block scales (not trainable) in place of the plain weight."""
        nb = (-(-self.out_features // block[0]), -(-self.in_features // block[1]))
        if w8.dtype != FP8 or tuple(w8.shape) != (self.out_features, self.in_features) or tuple(scale.shape) != nb:
            raise ValueError(f"fp8 weight {w8.dtype} {list(w8.shape)} / scale {list(scale.shape)}: expected "
                             f"{FP8} {[self.out_features, self.in_features]} / {list(nb)} for block {list(block)}")
        self.weight = nn.Parameter(w8, requires_grad=False)
        self.weight_scale = nn.Parameter(scale.float(), requires_grad=False)
        self.block = tuple(block)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype`: the parameter itself when plain and already `dtype` (autograd flows);
        for FP8 a transient dequantised copy, for callers that need W itself (the absorbed MLA's wkv_b)."""
        if not self.fp8:
            return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        return weight_dequant(self.weight, self.weight_scale, self.block, dtype)

    def dequantized_rows(self, dtype: torch.dtype, groups: int, part: slice) -> torch.Tensor:
        """Rows `part` of each of `groups` equal row groups of the weight: [groups, len(part), in] in `dtype`.

        An FP8 weight dequantises only those rows when they are whole scale blocks (each head's half of the absorbed
        MLA's wkv_b at the spec's sizes), else all of it and slices."""
        w = self.weight.view(groups, -1, self.in_features)                     # [G, rows, in]
        size = w.shape[1]
        lo, hi, _ = part.indices(size)
        if not self.fp8:
            return w[:, lo:hi] if w.dtype == dtype else w[:, lo:hi].to(dtype)
        b0 = self.block[0]
        if size % b0 or lo % b0 or hi % b0:
            return self.dequantized(dtype).view(groups, size, -1)[:, lo:hi]
        s = self.weight_scale.view(groups, size // b0, -1)[:, lo // b0: hi // b0]   # [G, (hi-lo)/B0, in/B1]
        return weight_dequant(w[:, lo:hi].reshape(-1, self.in_features), s.reshape(-1, s.shape[-1]), self.block,
                              dtype).view(groups, hi - lo, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x [..., in] -> [..., out]
        if not self.fp8:
            return F.linear(x, self.weight, self.bias)
        if x.dtype == torch.bfloat16 and x.shape[-1] % self.block[1] == 0 and self.out_features % self.block[0] == 0 \
                and blockwise_scaled_mm_ok(x.device, self.block):
            y = scaled_mm_fp8_linear(x, self.weight, self.weight_scale, self.block)
        else:
            y = tiled_fp8_linear(x, self.weight, self.weight_scale, self.block)
        return y if self.bias is None else y + self.bias.to(y.dtype)
