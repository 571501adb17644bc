"""The top-k-only training forward: the inference model's math over Sel(t), its candidate sets, and the
indexer loss that trains only indexers (every layer kind of the tiny preset)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import full_forward, random_tokens, selection_sets, tiny_model
import hisparse.train.topk_forward as tf
from hisparse.train.forward import train_forward
from hisparse.train.topk_forward import topk_forward

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("recent", [0, 5])
def test_topk_forward_is_the_inference_math(seed: int, recent: int):
    """Logits equal ML4.forward's (fp64), and the masked sparse training forward's, for two sequences in a batch,
    whatever the indexer KL's recent window (attention reads Sel(t) only)."""
    model = tiny_model(seed)
    T = 48
    tokens = torch.stack([random_tokens(T, model.cfg.vocab_size, seed),
                          random_tokens(T, model.cfg.vocab_size, seed + 1)])
    refs = [full_forward(model, tokens[b])[0] for b in range(2)]
    logits, kl = topk_forward(model, tokens, recent)
    assert torch.allclose(logits, torch.cat(refs), rtol=1e-9, atol=1e-9), (logits - torch.cat(refs)).abs().max()
    masked, _ = train_forward(model, tokens, model.cfg.index_topk)
    assert torch.allclose(logits, masked, rtol=1e-9, atol=1e-9)
    assert kl.shape == (len(model.cfg.index_owner_layers), 2 * T) and torch.isfinite(kl).all() and (kl >= 0).all()


def test_each_querys_indexer_kl_is_its_own(seed: int):
    """The per-query KL [owners, B T] a trainer weights by query (a needle's answer above the rest): a query's
    entry is the same in a batch as with its sequence alone, and it trains the indexers through that query only
    (a query before a changed token keeps its KL)."""
    model = tiny_model(seed)
    T = 40
    a, b = random_tokens(T, model.cfg.vocab_size, seed), random_tokens(T, model.cfg.vocab_size, seed + 1)
    _, both = topk_forward(model, torch.stack([a, b]), 5)
    _, alone = topk_forward(model, b[None], 5)
    assert torch.allclose(both[:, T:], alone, rtol=1e-12, atol=1e-12)
    changed = b.clone()
    changed[30] = (b[30] + 1) % model.cfg.vocab_size
    _, after = topk_forward(model, changed[None], 5)
    assert torch.allclose(after[:, :30], alone[:, :30], rtol=1e-12, atol=1e-12) and not torch.allclose(after[:, 30:], alone[:, 30:])


def recorded_candidates(monkeypatch: pytest.MonkeyPatch) -> list[tf.Candidates]:
    """The list that every later `candidates` call of topk_forward appends its result to."""
    seen, real = [], tf.candidates

    def recording(*args):
        seen.append(real(*args))
        return seen[-1]
    monkeypatch.setattr(tf, "candidates", recording)
    return seen


def test_candidates_are_selection_plus_recent(seed: int, monkeypatch: pytest.MonkeyPatch):
    """Per owner and query: `selected` is exactly the inference Sel(t), `scored` is Sel(t) ∪ (t - W, t], each
    key once, rows point into the query's own sequence, and newest_missing counts the newest keys not in Sel(t).
    `kept` receives the same candidates."""
    model = tiny_model(seed)
    T, W = 40, 6
    tokens = torch.stack([random_tokens(T, model.cfg.vocab_size, seed + 7),
                          random_tokens(T, model.cfg.vocab_size, seed)])
    traces = [full_forward(model, tokens[b])[1] for b in range(2)]
    seen, kept = recorded_candidates(monkeypatch), {}
    topk_forward(model, tokens, W, kept=kept)
    owners = model.cfg.index_owner_layers
    assert len(seen) == len(owners) and list(kept) == owners and all(kept[o] is c for o, c in zip(owners, seen))
    for cand, layer in zip(seen, owners):
        missing = tf.newest_missing(cand, W - 2)
        for b in range(2):
            want = selection_sets(traces[b].selections[layer][0])
            for t in range(T):
                n = b * T + t
                rows = cand.rows[n]
                assert ((rows >= b * T) & (rows <= n)).all()
                pos = (rows - b * T).tolist()
                sel = sorted(p for p, s in zip(pos, cand.selected[n].tolist()) if s)
                scored = [p for p, s in zip(pos, cand.scored[n].tolist()) if s]
                assert sel == want[t], (layer, b, t)
                assert sorted(scored) == sorted(set(want[t]) | set(range(max(0, t - W + 1), t + 1)))
                assert len(scored) == len(set(scored))
                assert missing[n] == len(set(range(max(0, t - W + 3), t + 1)) - set(want[t])), (layer, b, t)


def test_widened_owner_selects_its_recent_keys_from_a_position_on(seed: int, monkeypatch: pytest.MonkeyPatch):
    """The `widened` ablation: the one owner's queries from position p on attend over Sel(t) plus the recent keys
    (selected == scored there), every other query and owner keeps Sel(t), and logits before p are unchanged."""
    model = tiny_model(seed)
    T, W, p = 40, 6, 25
    tokens = random_tokens(T, model.cfg.vocab_size, seed + 3)[None]
    owner = model.cfg.index_owner_layers[0]
    plain, _ = topk_forward(model, tokens, W)
    seen = recorded_candidates(monkeypatch)
    logits, _ = topk_forward(model, tokens, W, widened={owner: p})
    widened_any = False
    for cand, layer in zip(seen, model.cfg.index_owner_layers):
        same = (cand.selected == cand.scored).all(dim=1)
        k = cand.selected.shape[1] - W
        assert torch.equal(cand.selected[:, :k], cand.scored[:, :k])          # Sel(t) itself is always read
        extra = cand.selected[:, k:]
        if layer == owner:
            assert same[p:].all() and not extra[:p].any()
            widened_any |= bool((~same[:p]).any())
        else:
            assert not extra.any()
    assert widened_any, "no query before p had a recent key outside Sel(t): the test cannot tell"
    assert torch.allclose(logits[:p], plain[:p], rtol=1e-9, atol=1e-9)      # fp64: rounding-level at most
    assert not torch.allclose(logits[p:], plain[p:], rtol=1e-6, atol=1e-6)


def test_topk_indexer_loss_trains_only_the_indexers(seed: int):
    model = tiny_model(seed, dtype=torch.float32, sharp=False).train()
    tokens = random_tokens(30, model.cfg.vocab_size, seed)[None]
    logits, kl = topk_forward(model, tokens, 4)
    kl.mean().backward(retain_graph=True)
    indexer = [p.grad for n, p in model.named_parameters() if ".indexer." in n]
    assert any(g is not None and g.abs().sum() > 0 for g in indexer)
    assert all(p.grad is None or p.grad.abs().sum() == 0 for n, p in model.named_parameters() if ".indexer." not in n)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(logits[:-1], tokens[0, 1:]).backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for n, p in model.named_parameters() if ".indexer." in n)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if ".wkv_b." in n)


@pytest.mark.parametrize("chunk", [1, 7, 45])
def test_query_chunks_change_no_value(seed: int, chunk: int):
    """Checkpointed query chunks (sizes that do and do not divide the batch's rows) give the logits and the indexer
    KL of the one-piece forward bit for bit, and its gradients up to the order in which chunks add them (fp64)."""
    model = tiny_model(seed, sharp=False).train()
    T = 30
    tokens = torch.stack([random_tokens(T, model.cfg.vocab_size, seed),
                          random_tokens(T, model.cfg.vocab_size, seed + 3)])

    def run(query_chunk: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logits, kl = topk_forward(model, tokens, 4, query_chunk)
        (F.cross_entropy(logits, tokens.flatten()) + kl.mean()).backward()
        return logits.detach(), kl.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.grad is not None}

    ref_logits, ref_kl, ref_grads = run(2 * T)
    logits, kl, grads = run(chunk)
    assert torch.equal(logits, ref_logits) and torch.equal(kl, ref_kl)
    assert grads.keys() == ref_grads.keys() and any(".indexer." in n for n in grads)
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], rtol=1e-10, atol=1e-13), name


def test_query_chunks_bound_what_autograd_keeps(seed: int):
    """The bytes autograd saves for the backward pass: the one-piece forward keeps each query's K gathered rows
    (O(T K)), the chunked one keeps per-row tensors only, so at a candidate set as wide as the sequence it keeps
    under a third as much."""
    model = tiny_model(seed, dtype=torch.float32, sharp=False).train()
    T = 256
    tokens = random_tokens(T, model.cfg.vocab_size, seed)[None]

    def saved_bytes(query_chunk: int) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            topk_forward(model, tokens, T, query_chunk)
        return total

    assert saved_bytes(16) * 3 < saved_bytes(T)
