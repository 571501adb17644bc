"""The grouped-GEMM MoE kernels (Triton: compiled on CUDA tensors where CUDA is present, interpreted on CPU tensors
otherwise) against the per-expert torch path: the device-side alignment of (token, slot) pairs by expert, and the
routed experts' output over plain and FP8 expert weights, every expert local or an expert-parallel rank's subset,
batches from 1 token up, experts with no token."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_model
from hisparse.core import triton_support
from hisparse.core.batch import Segment
from hisparse.model.kernels.moe_triton import BLOCK_M, align
from hisparse.kv.resident import ResidentKV
from hisparse.model.linear import weight_quant
from hisparse.model.moe import MoE, route

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(not triton_support.interpreted() and not torch.cuda.is_available(),
                                 reason="needs Triton's interpreter (CPU) or CUDA")]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("n, first, n_local", [(1, 0, 8), (7, 0, 8), (40, 2, 3), (3, 6, 2)])
def test_align_groups_every_local_pair_once(seed: int, n: int, first: int, n_local: int) -> None:
    g = torch.Generator().manual_seed(seed + n)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(n)])          # [n, 2], distinct per row
    pairs, bexp = (t.cpu() for t in align(ids.to(DEV), first, n_local))
    flat = ids.flatten()
    local = [p for p in range(flat.numel()) if first <= flat[p] < first + n_local]
    assert sorted(p for p in pairs.tolist() if p >= 0) == local                           # each local pair once
    assert pairs.numel() == bexp.numel() * BLOCK_M
    for b, e in enumerate(bexp.tolist()):
        block = [p for p in pairs[b * BLOCK_M:(b + 1) * BLOCK_M].tolist() if p >= 0]
        if e < 0:
            assert not block
        else:
            assert block and all(flat[p] == first + e for p in block)
            assert block == sorted(block)                                                 # stable: token order
    used = [e for e in bexp.tolist() if e >= 0]
    assert used == sorted(used) and set(used) == {int(flat[p]) - first for p in local}


def test_align_reads_nothing_on_the_host(seed: int) -> None:
    """The grouping runs on the device without a host read (no bincount, nonzero, item, ...), as the layer loop
    requires; audited as test_host_sync audits the decode path."""
    from test_host_sync import SyncAudit
    ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(seed + i))[:2]
                       for i in range(9)]).to(DEV)
    audit = SyncAudit()
    audit.active = True
    with audit, audit.host_reads():
        align(ids, 1, 6)
    assert not audit.sites, audit.sites


def moe_layer(seed: int, fp8: bool, dim: int = 64, hidden: int = 48) -> MoE:
    """An fp32 MoE layer of a tiny model on DEV, its experts' linears plain or FP8 (16 x 16 blocks)."""
    model = tiny_model(seed, torch.float32, sharp=False, dim=dim, moe={"expert_hidden_dim": hidden})
    moe = next(b.moe for b in model.layers if b.spec.ffn != "dense")
    if fp8:
        for expert in moe.experts:
            for lin in (expert.w1, expert.w2, expert.w3):
                lin.to_fp8(*weight_quant(lin.weight.detach(), (16, 16)), (16, 16))
    return moe.to(DEV)


@torch.no_grad()
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("n, local", [(1, None), (5, None), (37, None), (37, (2, 5))])
def test_grouped_experts_equal_the_per_expert_path(seed: int, fp8: bool, n: int, local) -> None:
    moe = moe_layer(seed, fp8)
    if local is not None:                        # an expert-parallel rank: experts 2..4 only
        moe.local_experts = range(*local)
    y = (torch.randn(n, 64, generator=torch.Generator().manual_seed(seed)) * 3).to(DEV)
    ids, gates = route(torch.nn.functional.linear(y, moe.gate.weight), moe.top_k)
    want = moe.per_expert(y, ids, gates)
    got = moe.grouped(y, ids, gates)
    assert got.dtype == y.dtype and got.shape == y.shape
    err = float((got - want).abs().max() / want.abs().max())
    print(f"n={n} local={local} fp8={fp8}: max relative error {err:.1e}")
    assert err < 2e-6
    # the experts' parameters are views of the stacks (one copy), and the torch path still reads them
    st = moe.stacked()
    e0 = moe.local_experts.start
    assert moe.experts[e0].w1.weight.data_ptr() == st.w1.data_ptr()
    assert torch.equal(moe.per_expert(y, ids, gates), want)


def test_model_with_grouped_experts_gives_the_torch_logits(seed: int) -> None:
    """A whole forward (dense layer 0, MoE layers) with --kernels triton for the experts vs torch."""
    model = tiny_model(seed, torch.float32, sharp=False).to(DEV)
    tokens = torch.randperm(model.cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[:40].to(DEV)

    def forward() -> torch.Tensor:
        return model(tokens, [Segment(0, 0, len(tokens))], ResidentKV(model.cfg, None, DEV))
    want = forward()
    model.use_kernels("triton")
    got = forward()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
def test_grouped_experts_in_half_precision(seed: int, dtype: torch.dtype, fp8: bool) -> None:
    """bf16/fp16 activations (and weights, unless FP8): the kernels accumulate in fp32 and round once at the end;
    against the same layer in fp64, their error is at most twice the per-expert torch path's in the same dtype,
    or twice the rounding of the exact result to that dtype (which no output in it avoids)."""
    from lockstep import no_less_exact
    half = moe_layer(seed, fp8)
    if fp8:      # FP8 linears keep their e4m3 weights; the rest of the layer computes in `dtype`
        half.gate.to(dtype)
    else:
        half.to(dtype)
    exact_moe = copy.deepcopy(half).to(torch.float64)     # the same weights, exactly, computed in fp64
    y = (torch.randn(37, 64, generator=torch.Generator().manual_seed(seed)) * 3).to(DEV)
    ids, gates = route(torch.nn.functional.linear(y, moe_layer(seed, fp8).gate.weight), half.top_k)
    exact = exact_moe.per_expert(y.double(), ids, gates.double())
    want = half.per_expert(y.to(dtype), ids, gates.to(dtype))
    got = half.grouped(y.to(dtype), ids, gates.to(dtype))
    assert got.dtype == dtype and got.shape == y.shape
    assert no_less_exact(got, want, exact), (float((got.double() - exact).abs().max()),
                                            float((want.double() - exact).abs().max()))
