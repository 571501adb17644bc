"""Needles trained live in a cached haystack (`prefix_forward`): the haystack a round caches once, and each step's
needle, question and answer as live rows placed in it.

The live rows are the prompt `passkey.sample_prompt` would build around the same haystack: the needle at a unit
boundary (its own paragraph after a paragraph end), then the question, the completion cue, the answer and EOS
after the haystack. The needle's rows take the positions of the haystack rows that follow it (those keep their
cached states); the question's rows take the positions the whole prompt gives them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.ml4 import ML4
from .passkey import COMPLETION_CUE, INTRO, QUESTION, SyntheticHaystack, answer, haystack_units, needle_text
from .prefix_forward import HaystackCache, cache_haystack

Encode = Callable[..., list[int]]   # the tokenizer's encode(text, bos=, eos=)


@dataclass
class FrozenHaystack:
    """A cached synthetic haystack (BOS, the prompt's intro, `chars` characters of filler) and where a needle may
    go: the token index of each unit's start, plus the end."""
    cache: HaystackCache
    starts: list[int]
    paragraph: list[bool]       # a needle at starts[j] is its own paragraph (after a paragraph end, or first)


@dataclass
class LiveNeedle:
    """One step's live rows (`prefix_forward`'s inputs) and their targets."""
    tokens: torch.Tensor        # [n] needle, question, cue, answer (the EOS only a target)
    after: torch.Tensor         # [n] haystack rows before each
    positions: torch.Tensor     # [n]
    targets: torch.Tensor       # [n] the next live token (rows whose next token is not live: any)
    valid: torch.Tensor         # [n] bool: the next token is live (every row but the needle's last)
    ans: torch.Tensor           # [n] bool: the target is the answer or its EOS


def build_haystack(model: ML4, encode: Encode, seed: int, chars: int, recent: int) -> FrozenHaystack:
    """Cache the synthetic haystack of `seed` (`chars` characters, cut as the benchmark cuts it) under `model`'s
    current weights; one token per character (the byte-level tokenizer)."""
    units = haystack_units(SyntheticHaystack(seed), chars)
    ids = encode(INTRO + "".join(units), bos=True, eos=False)
    starts = [1 + len(INTRO)]
    for u in units:
        starts.append(starts[-1] + len(u))
    if starts[-1] != len(ids):
        raise ValueError("build_haystack needs a tokenizer with one token per character")
    paragraph = [True] + [u.endswith("\n\n") for u in units]
    return FrozenHaystack(cache_haystack(model, torch.tensor(ids), recent), starts, paragraph)


def live_needle(hay: FrozenHaystack, encode: Encode, eos: int, value: str, depth: float) -> LiveNeedle:
    """The live rows of a needle with `value` at the unit boundary nearest `depth` (0..1) of the haystack."""
    j = round(depth * (len(hay.starts) - 1))
    needle = encode(needle_text(value, hay.paragraph[j]), bos=False, eos=False)
    tail = encode(QUESTION + COMPLETION_CUE, bos=False, eos=False)
    ans = encode(answer(value), bos=False, eos=False) + [eos]
    L, N = len(needle), hay.cache.tokens.numel()
    seq = torch.tensor(needle + tail + ans)
    n = seq.numel() - 1                                            # the last target (EOS) is not an input
    after = torch.tensor([hay.starts[j]] * L + [N] * (n - L))
    positions = torch.cat((hay.starts[j] + torch.arange(L), N + torch.arange(L, n)))
    rows = torch.arange(n)
    return LiveNeedle(seq[:n], after, positions, seq[1:], rows != L - 1, rows >= L + len(tail) - 1)

