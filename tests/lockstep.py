"""Two real KV stores driven by one forward, for comparing kernel paths on identical inputs.

A forward through `LockstepKV(reference, candidate)` sends every seam call to both stores with the same arguments
and hands the model the reference's result, so at every layer both stores see the same rows, keys and queries.
The candidate's result is compared with the reference's: integer results (selections, slots) exactly, floating
ones (attention output, LSE) within `rtol`/`atol`. This isolates what a kernel path changes from what a
free-running comparison adds on top: with quantised stored rows, an attention output that differs in its last
fp32 bit changes the next layer's input, and one stored fp8 element rounding the other way moves the logits by
far more than the kernels' own disagreement.

In a low-precision dtype (bf16) the two paths round differently and a fixed tolerance means little; given an
`exact` store (the reference's kind in fp64), every call also goes to it with its floating arguments widened
(exactly), and a floating result of the candidate passes when it is no farther from the exact one than twice the
reference's distance, or twice the rounding of the exact result to the dtype (`no_less_exact`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from hisparse.kv.base import LatentKV


def _clone(value: Any, dtype: torch.dtype | None = None) -> Any:
    """A copy of value (tensors inside lists and tuples too); floating tensors converted to dtype if given."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v, dtype) for v in value)
    return value


def max_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest absolute difference from an exact (fp64) result, where that is finite; its -inf entries (an empty
    attention's LSE) must be -inf in got too."""
    finite = torch.isfinite(exact)
    assert torch.equal(torch.isneginf(got), torch.isneginf(exact)), "-inf entries differ"
    return float((got.double() - exact.double())[finite].abs().max()) if finite.any() else 0.0


def no_less_exact(got: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor, factor: float = 2.0) -> bool:
    """Whether got (a kernel's result in a low-precision dtype) is at most `factor` times farther from the exact
    result than reference (the torch path's) is, or than the exact result rounded to got's dtype is (an error no
    output in that dtype avoids)."""
    floor = max_error(exact.to(got.dtype), exact)
    return max_error(got, exact) <= factor * max(max_error(reference, exact), floor)


class LockstepKV:
    """Forwards every call to `reference` and `candidate`; returns the reference's result, checks the candidate's."""

    def __init__(self, reference: LatentKV, candidate: LatentKV, rtol: float = 1e-5, atol: float = 1e-5,
                 exact: LatentKV | None = None) -> None:
        self.reference, self.candidate, self.exact = reference, candidate, exact
        self.rtol, self.atol = rtol, atol
        self.compared: Counter[str] = Counter()      # seam call name -> calls whose results were compared

    def __getattr__(self, name: str) -> Any:
        ref = getattr(self.reference, name)
        if not callable(ref):
            return ref
        cand = getattr(self.candidate, name)

        def both(*args: Any, **kwargs: Any) -> Any:
            out = ref(*_clone(args), **_clone(kwargs))
            exact = None
            if self.exact is not None:
                wide = self.exact.dtype
                exact = getattr(self.exact, name)(*_clone(args, wide), **_clone(kwargs, wide))
            self._check(name, out, cand(*_clone(args), **_clone(kwargs)), exact)
            if out is not None:
                self.compared[name] += 1
            return out
        return both

    def _check(self, name: str, a: Any, b: Any, exact: Any = None) -> None:
        if isinstance(a, dict):       # begin_step's device views: the stores stage the same tables
            for key in a.keys() & b.keys():
                self._check(f"{name}[{key}]", a[key], b[key])
            return
        if isinstance(a, (tuple, list)):
            assert isinstance(b, type(a)) and len(a) == len(b), name
            for x, y, e in zip(a, b, exact if exact is not None else [None] * len(a)):
                self._check(name, x, y, e)
            return
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, name
            if a.is_floating_point() and exact is not None:
                assert no_less_exact(b, a, exact), \
                    f"{name}: error {max_error(b, exact):.3g} against the exact result, the reference's " \
                    f"{max_error(a, exact):.3g}"
            elif a.is_floating_point():
                torch.testing.assert_close(b, a, rtol=self.rtol, atol=self.atol, equal_nan=True,
                                           msg=lambda m: f"{name}: {m}")
            else:
                assert torch.equal(a, b), f"{name}: integer results differ"
            return
        assert not callable(a), f"{name} returns a callable: compare what it yields instead"
        assert a == b, f"{name}: {a!r} != {b!r}"
