"""Passkey accuracy of a checkpoint through the inference path (ML4.forward over any LatentKV), with each
indexer-owning layer's needle recall (whether that layer's top-k selection, at the position that predicts the
answer's first digit, holds any of the passkey's tokens) and local recall (how many of the newest keys it holds:
far-away look-alikes crowding them out is what breaks a model past its training length). `train-needle` reports
it; the served benchmark is `benchmarks/needle`."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.generate import greedy_generate
from ..core.batch import ForwardTrace
from ..kv.base import LatentKV
from ..model.ml4 import ML4
from .passkey import sample_prompt

NEAR_KEYS = 16   # the local context a byte-level model needs to read the cue (about three words)


@dataclass
class PasskeyResult:
    tokens: int                    # prompt tokens
    depth: float
    value: str
    completion: str
    found: bool
    recall: dict[int, float]       # indexer-owner layer -> 1.0 if Sel(t) holds a passkey token, t the position
                                   # that predicts the first digit
    local: dict[int, float]        # indexer-owner layer -> share of the NEAR_KEYS keys up to t that Sel(t) holds


def find(seq: list[int], sub: list[int]) -> int:
    """Index of the first occurrence of sub in seq (-1 if absent)."""
    n = len(sub)
    return next((i for i in range(len(seq) - n + 1) if seq[i:i + n] == sub), -1)


def passkey_trial(model: ML4, kv: LatentKV, tokenizer, chars: int, depth: float, rng: random.Random,
                  max_tokens: int = 10) -> PasskeyResult:
    """One fresh passkey prompt of about `chars` haystack characters, greedy-decoded through `kv`."""
    text, value = sample_prompt(rng, chars, depth)
    ids = tokenizer.encode(text, bos=True, eos=False)
    digits = tokenizer.encode(value, bos=False, eos=False)
    at = find(ids, digits)
    trace = ForwardTrace()   # the forward that predicts the first digit (the answer starts with a space)
    gen = greedy_generate(model, kv, ids, max_tokens, chunk=1024, stop_ids=(tokenizer.eos_id,), trace=trace,
                          trace_step=1)
    completion = tokenizer.decode(gen.tokens)
    started = gen.tokens[:1] == tokenizer.encode(" ", bos=False, eos=False)   # else nothing was traced usefully
    recall, local = {}, {}
    t = len(ids)                     # the traced query: the generated space
    for layer in model.cfg.index_owner_layers:
        chosen = set(trace.selections[layer][0][-1].tolist()) if started and layer in trace.selections else set()
        recall[layer] = float(any(p in chosen for p in range(at, at + len(digits))))
        local[layer] = sum(p in chosen for p in range(t - NEAR_KEYS + 1, t + 1)) / NEAR_KEYS
    found = completion.strip().rstrip(".").strip() == value
    return PasskeyResult(len(ids), depth, value, completion, found, recall, local)


def passkey_accuracy(model: ML4, make_kv: Callable[[], LatentKV], tokenizer, chars: int, n: int, seed: int = 0,
                     max_tokens: int = 10) -> list[PasskeyResult]:
    """n trials at depths spread evenly over [0, 1], on fresh prompts drawn from `seed`."""
    rng = random.Random(f"eval:{seed}:{chars}")
    return [passkey_trial(model, make_kv(), tokenizer, chars, i / max(1, n - 1), rng, max_tokens) for i in range(n)]
