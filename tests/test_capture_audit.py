"""The decode pieces CUDA graphs capture copy nothing between host and device and read no device value on the host.

Capture refuses both: a host<->device copy ("Cannot copy between CPU and CUDA tensors during CUDA graph capture",
e.g. a Python number written into one element of a device tensor, or an index tensor left on the host) and a host
read of a device value (`.item()`, `nonzero`, boolean masks, ...: test_host_sync's list). The audit runs exactly
the callables `cuda_graphs.BucketGraphs` captures (each `Piece.fn`, after the eager first run that precedes a
capture), with the Triton MoE path, for every bucket of a set of decode graphs, and records every such op with the
innermost frame of hisparse (or of this file) that made it.

Where it runs: on the 'meta' device. CPU tensors cannot tell the host from the device, and fake CUDA tensors
(FakeTensorMode) cannot even be sliced by a CPU-only torch ("PyTorch is not linked with support for cuda devices":
the indexing code takes a CUDA device guard). Meta tensors have shapes and dtypes and no data: every op runs its
meta kernel, so an op that mixes a CPU tensor with them, a copy across devices and a read of a value all reach the
audit (a read then fails, a meta tensor having no value, and the audit stops there). Triton launches are recorded,
not run (`triton_support.recording()`). Two ways a CUDA tensor meets the host that no op shows on meta are made
visible during the audit:
- `t[i] = 0`: on CUDA, indexing turns the number into a CPU tensor and copies it over (torch's
  THPVariable_setitem), elsewhere into a tensor on t's own device; `Tensor.__setitem__` converts numbers as on CUDA.
- `torch.tensor(data, device=d)` / `torch.as_tensor(data, device=d)` copy host data without an op the dispatcher
  sees: calls naming a device other than the CPU are recorded.
One CPU tensor is allowed beside device tensors: a 0-dim value for `fill_`, which reads it on the host (a CPU
value, no device involved); that is what `t[a:b] = 0` becomes on CUDA.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hisparse
from hisparse.engine.cuda_graphs import DecodeGraphs
from hisparse.core import triton_support
from hisparse.model import linear
from hisparse.core.config import ModelConfig, preset_params
from hisparse.model.kernels import moe_triton
from hisparse.model.linear import FP8
from hisparse.model.ml4 import ML4
from hisparse.model.tiny import random_model
from hisparse.model.weights import NEVER_QUANTISED, QSCALE, checkpoint_dtype, load_weights, to_checkpoint_name

from test_host_sync import host_reads, reads_device

pytestmark = pytest.mark.usefixtures("single_thread")

THIS = os.path.abspath(__file__)
SOURCES = (os.path.dirname(hisparse.__file__) + os.sep, THIS)
ROOT = os.path.dirname(os.path.dirname(THIS)) + os.sep
AUDIT_FRAMES = {"site", "record", "__torch_dispatch__", "cuda_setitem", "create", "audit"}   # this file's own
NUMBER = (bool, int, float, complex)
READS = "reads a device value on the host"


@dataclass(frozen=True)
class Refusal:
    """An op a CUDA graph capture refuses: what it is, why, and where (file:function:line, from the repo root)."""
    op: str
    why: str
    site: str


def site() -> str:
    """The innermost frame of hisparse or of this file's pieces under audit (not the audit's own frames)."""
    for f in reversed(traceback.extract_stack()[:-1]):
        if f.filename.startswith(SOURCES) and not (f.filename == THIS and f.name in AUDIT_FRAMES):
            return f"{f.filename.removeprefix(ROOT)}:{f.name}:{f.lineno}"
    return "?"


def crosses(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why an aten call copies between host and device (None if it does not): CPU tensors beside device tensors,
    or a copy to another device."""
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    devices = {t.device.type for t in tensors}
    name = func._schema.name.split("::")[-1]
    if "cpu" in devices and len(devices) > 1:
        if name == "fill_" and all(t.dim() == 0 for t in tensors if t.device.type == "cpu"):
            return None                               # a CPU value read on the host, as a number
        return f"CPU and {sorted(devices - {'cpu'})} tensors in one op"
    target = kwargs.get("device")
    if name == "_to_copy" and target is not None and tensors and torch.device(target).type != tensors[0].device.type:
        return f"copy from {tensors[0].device.type} to {torch.device(target).type}"
    return None


class CaptureAudit(TorchDispatchMode):
    """Records every op a CUDA graph capture refuses (see the module docstring) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.refusals: list[Refusal] = []

    def record(self, op: str, why: str) -> None:
        self.refusals.append(Refusal(op, why, site()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = READS if reads_device(func, args) else crosses(func, args, kwargs)
        if why is not None:
            self.record(str(func), why)
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def host_boundaries(self) -> Iterator[None]:
        """The host<->device steps no dispatched op shows on meta tensors (module docstring), and host reads."""
        setitem = torch.Tensor.__setitem__

        def cuda_setitem(t, index, value):
            if isinstance(value, NUMBER) and t.device.type != "cpu":
                value = torch.tensor(value, dtype=t.dtype)            # what indexing makes of a number on CUDA
            return setitem(t, index, value)

        def from_host(make: Callable) -> Callable:
            def create(data, *args, device=None, **kwargs):
                if device is not None and torch.device(device).type != "cpu":
                    self.record(f"torch.{make.__name__}", f"copy of host data to {torch.device(device).type}")
                return make(data, *args, device=device, **kwargs)
            return create
        with (mock.patch.object(torch.Tensor, "__setitem__", cuda_setitem),
              mock.patch.object(torch, "tensor", from_host(torch.tensor)),
              mock.patch.object(torch, "as_tensor", from_host(torch.as_tensor)),
              host_reads(lambda method: self.record(f"Tensor.{method}", READS))):
            yield


def audit(fn: Callable[[], object]) -> list[Refusal]:
    """The ops of fn() a CUDA graph capture refuses; fn stops at the first that needs a value a meta tensor has
    not."""
    rec = CaptureAudit()
    try:
        with rec, rec.host_boundaries():
            fn()
    except Exception:            # noqa: BLE001 - a meta tensor's missing value, after its read was recorded
        if not rec.refusals:
            raise
    return rec.refusals


def piece_refusals(model: ML4, max_rows: int) -> dict[tuple[int, int], list[Refusal]]:
    """(bucket size, piece) -> what capture would refuse in that piece, for every bucket of DecodeGraphs(model,
    max_rows), with the Triton kernels recorded, not run."""
    model.use_kernels("triton")
    with triton_support.recording() as launches:
        graphs = DecodeGraphs(model, max_rows, capture=False)     # every piece's eager first run, as before capture
        out = {(size, i): audit(piece.fn) for size, bucket in graphs.buckets.items()
               for i, piece in enumerate(bucket.pieces)}
    assert any(s.kernel.endswith("_gate_up_kernel") for s in launches), "the MoE took its Triton path"
    return out


class MetaCheckpoint:
    """A release checkpoint's tensors as `load_weights` reads them, on the meta device: names, shapes and dtypes
    (linear weights FP8 with their block scales, as save_model quantises them), no data."""

    def __init__(self, model: ML4, block: tuple[int, int]):
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for pname, p in model.named_parameters():
            name = to_checkpoint_name(pname)
            if p.dim() == 2 and not NEVER_QUANTISED.search(name):
                self.tensors[name] = (tuple(p.shape), FP8)
                self.tensors[name + QSCALE] = ((-(-p.shape[0] // block[0]), -(-p.shape[1] // block[1])),
                                               torch.float32)
            else:
                self.tensors[name] = (tuple(p.shape), checkpoint_dtype(name))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][0]

    def read(self, name: str, region: object = None) -> torch.Tensor:
        shape, dtype = self.tensors[name]
        return torch.empty(shape, dtype=dtype, device="meta")


def meta_model(preset: str, dtype: torch.dtype, fp8_block: tuple[int, int] | None = None) -> ML4:
    """A model of `preset` on the meta device, computing in `dtype`, its linears FP8 with `fp8_block` scales (as a
    checkpoint loads) or plain."""
    cfg = ModelConfig.from_params(preset_params(preset))
    with torch.device("meta"):
        model = ML4(cfg)
    if fp8_block is None:
        return model.to(dtype).eval()
    load_weights(model, MetaCheckpoint(model, fp8_block), fp8_block, "meta", dtype, progress=False)
    return model.eval()


@pytest.fixture
def blockwise_gemm(monkeypatch):
    """FP8 linears of bf16 activations take the blockwise FP8 GEMM (`torch._scaled_mm`), as on an H200 whose probe
    passed; the probe itself runs on CUDA only."""
    monkeypatch.setattr(linear, "blockwise_scaled_mm_ok", lambda device, block: tuple(block) == (128, 128))


def assert_none(refusals: dict[tuple[int, int], list[Refusal]]) -> None:
    found = {key: r for key, r in refusals.items() if r}
    assert not found, "\n".join(f"bucket {size} piece {i}: {r.op} ({r.why}) at {r.site}"
                                for (size, i), rs in found.items() for r in rs)


def test_tiny_fp32_pieces_cross_nothing(seed: int) -> None:
    """The tiny model as the CPU tests run it (fp32, plain weights), every piece of the buckets of 1, 2 and 4
    rows."""
    model = random_model(preset_params("tiny"), seed=seed % 10_000).to("meta")
    refusals = piece_refusals(model, 4)
    assert {size for size, _ in refusals} == {1, 2, 4} and len(refusals) == 3 * (len(model.layers) + 1)
    assert_none(refusals)


@pytest.mark.slow
def test_full_size_bf16_fp8_pieces_cross_nothing(blockwise_gemm) -> None:
    """ML4 at its real sizes as an H200 serves it: bf16 activations, FP8 linears and experts (128 x 128 blocks:
    the blockwise GEMM where shapes allow, dequantised tiles where not), every piece of the buckets of 1, 2 and 4
    rows."""
    model = meta_model("full", torch.bfloat16, (128, 128))
    assert model.layers[1].moe.experts[0].w1.fp8
    refusals = piece_refusals(model, 4)
    assert len(refusals) == 3 * (len(model.layers) + 1)
    assert_none(refusals)


def old_align(ids: torch.Tensor, first: int, n_local: int, block_m: int = moe_triton.BLOCK_M
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_triton.align` as it was before it became capturable: its `padded[n_local] = 0` writes a Python number
    into a device tensor, a host-to-device copy of a CPU scalar on CUDA. Kept as the audit's counter-example."""
    flat = ids.flatten()
    P = flat.numel()
    p_max = -(-(P + n_local * (block_m - 1)) // block_m) * block_m
    local = flat - first
    key = torch.where((local >= 0) & (local < n_local), local, n_local)
    counts = torch.zeros(n_local + 1, dtype=torch.long, device=ids.device).scatter_add_(
        0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[n_local] = 0
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(key, stable=True)
    skey = key[order]
    rank = torch.arange(P, device=ids.device) - (torch.cumsum(counts, 0) - counts)[skey]
    dest = torch.where(skey < n_local, (ends - padded)[skey] + rank, p_max)
    pairs = torch.full((p_max + 1,), -1, dtype=torch.long, device=ids.device).scatter_(0, dest, order)[:p_max]
    starts = torch.arange(0, p_max, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends[:n_local], starts, right=True)
    return pairs, torch.where(block_expert < n_local, block_expert, -1)


def test_the_audit_flags_the_old_align(seed: int, monkeypatch) -> None:
    """With the old align in place, every piece that runs an MoE layer is flagged, at its `padded[n_local] = 0`,
    and no other piece."""
    monkeypatch.setattr(moe_triton, "align", old_align)
    model = random_model(preset_params("tiny"), seed=seed % 10_000).to("meta")
    refusals = piece_refusals(model, 2)
    lines, start = inspect.getsourcelines(old_align)
    line = start + next(i for i, text in enumerate(lines) if text.strip() == "padded[n_local] = 0")
    moe_pieces = {i for i in range(len(model.layers) + 1) if i and model.layers[i - 1].spec.ffn != "dense"}
    for (size, i), found in refusals.items():
        if i in moe_pieces:
            assert found and all(r.site == f"tests/test_capture_audit.py:old_align:{line}" for r in found), found
            assert found[0].op == "aten.copy_.default" and "CPU and ['meta']" in found[0].why
        else:
            assert not found, found


@pytest.mark.parametrize("n, first, n_local", [(1, 0, 8), (7, 0, 8), (40, 2, 3), (3, 6, 2), (9, 0, 1)])
def test_align_groups_as_the_old_align(seed: int, n: int, first: int, n_local: int) -> None:
    """Dropping the host write changed no result: the same pairs and block experts as before, for every local
    expert range."""
    g = torch.Generator().manual_seed(seed + n)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(n)])
    for got, want in zip(moe_triton.align(ids, first, n_local), old_align(ids, first, n_local), strict=True):
        assert torch.equal(got, want)


def on_meta(expr: Callable[[torch.Tensor], object]) -> Callable[[], object]:
    return lambda: expr(torch.zeros(4, dtype=torch.long, device="meta"))


@pytest.mark.parametrize("refused, fn", [
    (True, on_meta(lambda t: t.__setitem__(1, 0))),                              # a CPU scalar copied over
    (True, on_meta(lambda t: t[torch.tensor([0, 2])])),                          # a host index tensor
    (True, on_meta(lambda t: t.to("cpu"))),
    (True, on_meta(lambda t: t + torch.ones(4, dtype=torch.long))),
    (True, lambda: torch.tensor([1, 2], device="meta")),
    (True, on_meta(lambda t: t.sum().item())),
    (True, on_meta(lambda t: t.tolist())),
    (True, on_meta(lambda t: t.nonzero())),
    (True, on_meta(lambda t: t[t > 0])),
    (False, on_meta(lambda t: t.__setitem__(slice(1, 3), 0))),                   # fill_ with a host number
    (False, on_meta(lambda t: torch.where(t > 0, t, -1) + 1)),
    (False, on_meta(lambda t: t[1:].zero_().cumsum(0)[torch.zeros(2, dtype=torch.long, device="meta")])),
    (False, lambda: torch.full((3,), 7, device="meta")),
], ids=["setitem", "host-index", "to-cpu", "cpu-operand", "tensor", "item", "tolist", "nonzero", "bool-mask",
        "fill", "where-scalar", "device-ops", "factory"])
def test_the_audit_rules(refused: bool, fn: Callable[[], object]) -> None:
    assert bool(audit(fn)) == refused
