"""The frozen-haystack training forward: live rows inserted into a cached haystack give `topk_forward`'s logits and
indexer KL at those rows when the cache holds the merged sequence's own hidden states (every layer kind of the
tiny preset), and its loss trains the key projections through the haystack's keys."""

from __future__ import annotations

import pytest
import torch

from conftest import random_tokens, tiny_model
from hisparse.train.prefix_forward import HaystackCache, cache_haystack, prefix_forward
from hisparse.train.topk_forward import topk_forward

pytestmark = pytest.mark.usefixtures("single_thread")


def split(model, tokens: torch.Tensor, live: torch.Tensor, recent: int) -> tuple[HaystackCache, torch.Tensor]:
    """The cache of `tokens` less the rows `live` (ascending), and each live row's count of haystack rows before
    it."""
    full = cache_haystack(model, tokens, recent)
    keep = torch.ones(tokens.numel(), dtype=torch.bool)
    keep[live] = False
    cache = HaystackCache(tokens[keep], full.positions[keep], [h[keep] for h in full.hidden])
    return cache, live - torch.arange(live.numel())


@pytest.mark.parametrize("recent", [0, 6])
def test_live_rows_in_a_cached_haystack_are_the_topk_forward(seed: int, recent: int):
    """A needle in the middle and the tail, run live against the cache of the rest: logits and per-query KL equal
    the whole sequence's topk_forward at those rows (fp64), with and without the KL's recent keys."""
    model = tiny_model(seed)
    T = 72
    tokens = random_tokens(T, model.cfg.vocab_size, seed)
    live = torch.cat((torch.arange(30, 36), torch.arange(T - 8, T)))
    cache, after = split(model, tokens, live, recent)
    logits, kl = prefix_forward(model, cache, tokens[live], after, live, recent)
    want_logits, want_kl = topk_forward(model, tokens[None], recent)
    assert torch.allclose(logits, want_logits[live], rtol=1e-9, atol=1e-9), (logits - want_logits[live]).abs().max()
    assert torch.allclose(kl, want_kl[:, live], rtol=1e-9, atol=1e-9), (kl - want_kl[:, live]).abs().max()


def test_the_live_loss_trains_key_projections_through_the_haystack(seed: int):
    """Backward reaches every owner's latent and indexer key projection, and every layer's cached haystack rows:
    the live rows read the haystack's keys, which the current weights recompute from the cache."""
    model = tiny_model(seed)
    T = 64
    tokens = random_tokens(T, model.cfg.vocab_size, seed)
    live = torch.arange(T - 10, T)
    cache, after = split(model, tokens, live, 4)
    for h in cache.hidden:
        h.requires_grad_(True)
    logits, kl = prefix_forward(model, cache, tokens[live], after, live, 4)
    (torch.nn.functional.cross_entropy(logits[:-1], tokens[live][1:]) + kl.mean()).backward()
    for i in model.cfg.index_owner_layers:
        assert model.layers[i].attention.indexer.wk.weight.grad.abs().sum() > 0, i
    for i in model.cfg.kv_owner_layers:
        assert model.layers[i].attention.wkv_a_with_mqa.weight.grad.abs().sum() > 0, i
        assert cache.hidden[i].grad[:T - 10].abs().sum() > 0, i
