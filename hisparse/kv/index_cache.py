"""How indexer keys are stored on the device (spec §4): `fp8` records or `fp32` (exact) keys.

fp8: one record per token per indexer-owning layer, dI x fp8_e4m3 || one fp32 scale (132 B at full size). The
scale is DeepSeek-V3.2's indexer-key quantizer (vLLM's `indexer_k_quant_and_cache` with ue8m0 scales): a power
of two, s = 2^ceil(log2(max(amax, AMAX_FLOOR) / 448)), k8 = e4m3(k / s). Because s is a power of two, the
dequantised key e4m3(k8) * s is exact in fp32 and fp64, the score dtypes (`indexer.score_dtype`); every scorer
decodes the records to those values in the score dtype (the CPU kernel and the Triton kernel as they gather them,
the torch path after its gather) and scores them as plain keys, so its scores are those of the naive reference
"quantise, dequantise, score" bit for bit. Queries are not quantised (the spec's reference omits their fp8
emulation, §8 A11).

fp32: keys in the compute dtype (the exact reference; named after the default float32 compute dtype), scored as
their values in the score dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..host_pool.layout import index_row_bytes
from .paged_store import PagedStore

INDEX_CACHES = ("fp8", "fp32")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4   # DeepSeek-V3.2 / vLLM: amax is clamped here, so an all-zero key gets a finite scale


def key_bytes(index_head_dim: int, form: str) -> int:
    """Device bytes of one token's key in one indexer layer: the fp8 record (132 at full size) or dI x fp32."""
    return index_row_bytes(index_head_dim) if form == "fp8" else 4 * index_head_dim


def key_scale(keys: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale [n] (fp32) of keys [n, dI]: 2^ceil(log2(max(amax, AMAX_FLOOR) / 448)), exactly."""
    x = keys.float().abs().amax(-1).clamp_min(AMAX_FLOOR) / FP8_MAX
    m, e = torch.frexp(x)                      # x = m 2^e, m in [0.5, 1): a power of two iff m == 0.5
    return torch.ldexp(torch.ones_like(x), e - (m == 0.5).int())


def quantise(keys: torch.Tensor) -> torch.Tensor:
    """keys [n, dI] (any float dtype) -> records [n, dI + 4] uint8 (e4m3 values, then the fp32 scale)."""
    s = key_scale(keys)
    k8 = (keys.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat((k8.view(torch.uint8), s[:, None].view(torch.uint8)), dim=1)


def dequantise(records: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """records [..., dI + 4] uint8 -> keys [..., dI] in `dtype` (exact: e4m3 x a power of two)."""
    dI = records.shape[-1] - 4
    k8 = records[..., :dI].contiguous().view(FP8).float()
    s = records[..., dI:].contiguous().view(torch.float32)
    return (k8 * s).to(dtype)


class IndexKeyStore(PagedStore):
    """One device tensor [rows, width] per indexer-owning layer, laid out in the pages of the KV store's
    `PageTable` (row = page * P + p % P), shared by every request; grows by doubling between steps.

    `write` stores keys in the chosen form; the scorers (`indexer.paged_topk`: the CPU kernel and the torch path,
    and the Triton kernel) read the store as it is and decode fp8 records themselves."""

    def __init__(self, layers: Sequence[int], head_dim: int, form: str, dtype: torch.dtype,
                 device: torch.device, page_tokens: int):
        if form not in INDEX_CACHES:
            raise ValueError(f"index_cache: must be one of {list(INDEX_CACHES)}, got {form!r}")
        self.form = form
        super().__init__(layers, index_row_bytes(head_dim) if form == "fp8" else head_dim,
                         torch.uint8 if form == "fp8" else dtype, device, page_tokens)

    def write(self, layer: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        """Store keys [n, dI] at store rows [n]."""
        self.data[layer].index_copy_(0, rows, quantise(keys) if self.form == "fp8" else keys.to(self.dtype))

    def bytes_per_token_layer(self) -> int:
        """Device bytes one token's key takes in one indexer layer (132 for fp8 at full size)."""
        return self.width * self.dtype.itemsize
