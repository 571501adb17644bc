"""Host synchronisations inside the decode layer loop, audited on the CPU.

On an accelerator every op whose result size or value the host must read (`.item()`, `int(t)`, `.tolist()`,
`nonzero`, `bincount`, `unique`, boolean-mask indexing, ...) stalls the stream. A CPU run cannot stall, so this
test records those ops instead: a `TorchDispatchMode` sees the aten ops, patched `Tensor` methods see the host
reads that bypass the dispatcher, and forward hooks on the layers keep only what runs inside the layer loop. The
native CPU kernels are switched off so the torch code a GPU runs is the code audited. The remaining sites are
listed below; a new one, or one whose count grows with the batch, fails the test. On the Triton path (every
kernel of `--kernels triton`, interpreted here; their bodies are device code and not audited) there is none.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hisparse
from hisparse.gpu_working_set import resolver
from hisparse.core import triton_support
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.host_pool import layout as layout_mod
from hisparse.core.batch import Segment
from hisparse.core.config import preset_params
from hisparse.kv.kernels import indexer_topk
from hisparse.kv.resident import ResidentKV
from hisparse.model.tiny import random_model

SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
            "equal", "is_nonzero", "bincount", "repeat_interleave", "allclose"}
HOST_READS = ("tolist", "item", "numpy", "__int__", "__bool__", "__float__", "__index__")
PACKAGE = os.path.dirname(hisparse.__file__) + os.sep
INTERPRETER = os.path.join("triton", "runtime", "interpreter.py")

# (file, function) -> why it reads the host. The MoE's torch path reads each expert's token count to slice its
# tokens (its Triton path, grouped GEMMs over stacked experts, has no host read: test_triton_moe audits it); the
# resolver reads the number of misses of an index group to size their copies (once per group and step, whatever
# the batch).
KNOWN = {
    ResidentKV: {("model/moe.py", "per_expert")},
    HiSparseKV: {("model/moe.py", "per_expert"), ("gpu_working_set/resolver.py", "resolve_torch")},
}


def reads_device(func: torch._ops.OpOverload, args: tuple) -> bool:
    """Whether an aten call makes the host wait for a device value: a sync op, or indexing by a boolean mask."""
    name = func._schema.name.split("::")[-1]
    indices = args[1] if name.startswith("index") and len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return name in SYNC_OPS or any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices)


@contextlib.contextmanager
def host_reads(record: Callable[[str], None]) -> Iterator[None]:
    """Call record(method) at every host read of a tensor that bypasses the dispatcher (`HOST_READS`)."""
    saved = {n: getattr(torch.Tensor, n) for n in HOST_READS}

    def wrap(name, fn):
        def read(t, *a, **k):
            record(name)
            return fn(t, *a, **k)
        return read
    for n, fn in saved.items():
        setattr(torch.Tensor, n, wrap(n, fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


class SyncAudit(TorchDispatchMode):
    """Counts sync-prone ops by their innermost hisparse frame, while `active`."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.sites: Counter = Counter()

    def record(self) -> None:
        if not self.active:
            return
        stack = traceback.extract_stack()
        if any(f.filename.endswith(INTERPRETER) for f in stack):   # a Triton kernel's body: device code on a GPU
            return
        f = [f for f in stack if f.filename.startswith(PACKAGE)][-1]
        self.sites[(f.filename[len(PACKAGE):], f.name)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if reads_device(func, args):
            self.record()
        return func(*args, **(kwargs or {}))

    def host_reads(self) -> contextlib.AbstractContextManager[None]:
        return host_reads(lambda _: self.record())


@pytest.fixture
def device_path(monkeypatch):
    """The torch code an accelerator runs: no native CPU kernels."""
    monkeypatch.setattr(resolver, "NATIVE", False)
    monkeypatch.setattr(layout_mod, "NATIVE", False)
    monkeypatch.setattr(indexer_topk, "available", lambda: False)


def decode_step_syncs(model, kv_class, n: int, index_cache: str = "fp32", kernels: str = "torch",
                      prompt: int = 48) -> Counter:
    cfg = model.cfg
    kw = {"host_pool_gib": 0.01, "hot_buffer_tokens": 16, "resident_window": 8} if kv_class is HiSparseKV else {}
    kv = kv_class(cfg, "fp8_ds_mla", index_cache=index_cache, kernels=kernels, **kw)
    model.use_kernels(kernels)
    prompts = torch.randint(0, cfg.vocab_size, (n, prompt))
    audit = SyncAudit()
    hooks = [h for layer in model.layers for h in (
        layer.register_forward_pre_hook(lambda *_: setattr(audit, "active", True)),
        layer.register_forward_hook(lambda *_: setattr(audit, "active", False)))]
    try:
        with torch.no_grad():
            model(prompts.flatten(), [Segment(r, 0, prompt) for r in range(n)], kv)
            model(prompts[:, -1], [Segment(r, prompt, 1) for r in range(n)], kv)   # warm: the hot slots fill
            with audit, audit.host_reads():
                model(prompts[:, -2], [Segment(r, prompt + 1, 1) for r in range(n)], kv)
    finally:
        for h in hooks:
            h.remove()
    return audit.sites


@pytest.mark.parametrize("index_cache", ["fp32", "fp8"])
@pytest.mark.parametrize("kv_class", [ResidentKV, HiSparseKV], ids=["resident", "hisparse"])
def test_decode_layer_loop_syncs_are_known_and_do_not_grow_with_the_batch(device_path, kv_class, index_cache):
    p = preset_params("tiny")
    p["index_topk"] = 32     # a selection smaller than the context: real misses and hits
    model = random_model(p, seed=0)
    one, many = (decode_step_syncs(model, kv_class, n, index_cache) for n in (1, 8))
    assert set(one) == set(many) == KNOWN[kv_class], "a host sync appeared in or left the decode layer loop"
    assert one == many, "host syncs grow with the batch"


@pytest.mark.slow
@pytest.mark.skipif(not triton_support.interpreted(), reason="needs Triton's interpreter (CPU) to audit on the CPU")
@pytest.mark.parametrize("kv_class", [ResidentKV, HiSparseKV], ids=["resident", "hisparse"])
def test_triton_decode_layer_loop_reads_nothing_on_the_host(device_path, kv_class):
    """With --kernels triton (miss path, indexer scores, radix top-k, sparse MLA, grouped MoE; interpreted here,
    their bodies are device code) the decode layer loop has no host synchronisation at all, at any batch."""
    p = preset_params("tiny")
    p["index_topk"] = 16     # below the 32-token context: misses and hits (hot buffer 16, window 8)
    model = random_model(p, seed=0)
    try:
        for n in (1, 3):
            assert not decode_step_syncs(model, kv_class, n, kernels="triton", prompt=32)
    finally:
        model.use_kernels("auto")


def test_the_audit_sees_a_sync(device_path):
    """The audit itself: a host read inside a layer is caught."""
    model = random_model(preset_params("tiny"), seed=0)
    layer = model.layers[1]
    forward = layer.forward

    def reading_forward(h, b, keep=None):
        int(h[0, 0] > 0)
        return forward(h, b, keep)
    layer.forward = reading_forward
    try:
        sites = decode_step_syncs(model, ResidentKV, 2)
    finally:
        del layer.forward
    assert sites[("model/ml4.py", "forward")] >= 1     # the innermost hisparse frame: the layer loop's call
    assert ("model/ml4.py", "forward") not in decode_step_syncs(model, ResidentKV, 2)
