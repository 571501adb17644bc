"""Two real KV stores driven by one forward, for comparing kernel paths on identical inputs.

A forward through `LockstepKV(reference, candidate)` sends every seam call to both stores with the same arguments
and hands the model the reference's result, so at every layer both stores see the same rows, keys and queries.
The candidate's result is compared with the reference's: integer results (selections, slots) exactly, floating
ones (attention output, LSE) within `rtol`/`atol`. This isolates what a kernel path changes from what a
free-running comparison adds on top: with quantised stored rows, an attention output that differs in its last
fp32 bit changes the next layer's input, and one stored fp8 element rounding the other way moves the logits by
far more than the kernels' own disagreement.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from hisparse.model.kv import LatentKV


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


class LockstepKV:
    """Forwards every call to `reference` and `candidate`; returns the reference's result, checks the candidate's."""

    def __init__(self, reference: LatentKV, candidate: LatentKV, rtol: float = 1e-5, atol: float = 1e-5) -> None:
        self.reference, self.candidate = reference, candidate
        self.rtol, self.atol = rtol, atol
        self.compared: Counter[str] = Counter()      # seam call name -> calls whose results were compared

    def __getattr__(self, name: str) -> Any:
        ref = getattr(self.reference, name)
        if not callable(ref):
            return ref
        cand = getattr(self.candidate, name)

        def both(*args: Any, **kwargs: Any) -> Any:
            out = ref(*_clone(args), **_clone(kwargs))
            self._check(name, out, cand(*_clone(args), **_clone(kwargs)))
            if out is not None:
                self.compared[name] += 1
            return out
        return both

    def _check(self, name: str, a: Any, b: Any) -> None:
        if isinstance(a, (tuple, list)):
            assert isinstance(b, type(a)) and len(a) == len(b), name
            for x, y in zip(a, b):
                self._check(name, x, y)
            return
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, name
            if a.is_floating_point():
                torch.testing.assert_close(b, a, rtol=self.rtol, atol=self.atol, equal_nan=True,
                                           msg=lambda m: f"{name}: {m}")
            else:
                assert torch.equal(a, b), f"{name}: integer results differ"
            return
        assert not callable(a), f"{name} returns a callable: compare what it yields instead"
        assert a == b, f"{name}: {a!r} != {b!r}"
