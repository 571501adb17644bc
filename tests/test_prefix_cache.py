"""Prefix caching: full pages stay cached after their request ends and a later request that starts with the same
tokens skips their prefill; its logits equal those of the same request served without the cache, bit for bit."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from hisparse.core.batch import Segment
from hisparse.core.config import preset_params
from hisparse.engine.engine import Engine
from hisparse.engine.request import SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.kv.resident import ResidentKV
from hisparse.model.tiny import random_model

pytestmark = pytest.mark.usefixtures("single_thread")

PAGE = 16
CHUNK = 16


@pytest.fixture(scope="module")
def model():
    p = preset_params("tiny")
    p["max_position_embeddings"] = 1 << 16
    return random_model(p, seed=int(torch.randint(0, 10_000, ()).item()))


def store(cfg, kind: str, layout: str, caching: bool, dtype: torch.dtype = torch.float32, pool_gib: float = 0.004):
    """A small store of `kind`: resident (ResidentKV), hisparse (always offload), hybrid (room for 64 pages) or
    spilling (hybrid with room for 3 pages)."""
    if kind == "resident":
        return ResidentKV(cfg, layout, dtype=dtype, page_tokens=PAGE, prefix_caching=caching)
    pages = {"hisparse": None, "hybrid": 64, "spilling": 3}[kind]
    probe = HiSparseKV(cfg, layout, host_pool_gib=0.001, page_tokens=PAGE)
    gib = None if pages is None else pages * probe.page_bytes / (1 << 30)
    return HiSparseKV(cfg, layout, "cpu", dtype, host_pool_gib=pool_gib, hot_buffer_tokens=16, resident_window=8,
                      page_tokens=PAGE, device_kv_gib=gib, prefix_caching=caching)


def serve(model, kv, req: str, tokens: list[int], decode: int) -> tuple[list[torch.Tensor], int]:
    """Admit req (its cached prefix, if any), prefill the rest in CHUNK-token chunks from position 0's grid, then
    decode greedily; the logits of every step's last row, and the tokens the request started from."""
    start = kv.admit(req, len(tokens) + decode, tokens[:-1])
    assert start is not None
    tokens, out, pos = list(tokens), [], start

    def forward(n: int) -> torch.Tensor:
        nonlocal pos
        logits = model(torch.tensor(tokens[pos:pos + n]), [Segment(req, pos, n)], kv)[-1]
        pos += n
        kv.commit_prefix(req, lambda s, k: tokens[s:s + k], pos)
        return logits

    while pos < len(tokens):
        last = forward(min(CHUNK - pos % CHUNK, len(tokens) - pos))
    out.append(last)
    for _ in range(decode):
        tokens.append(int(last.argmax()))
        last = forward(1)
        out.append(last)
    return out, start


@pytest.mark.parametrize("kind", ["resident", "hisparse", "hybrid", "spilling"])
@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16"])
def test_hit_is_bit_identical_to_miss(model, kind: str, layout: str) -> None:
    """A (doc + q1) runs and ends; B (doc + q2, diverging mid-page) starts from the doc's full pages, C (the first
    two pages of the doc, then other tokens, then the doc's later pages again) from two pages only. Every logit of
    B and C equals that of the same request on a store without the cache, and the cache's counters add up."""
    g = torch.Generator().manual_seed(7)
    doc = torch.randint(0, model.cfg.vocab_size, (87,), generator=g).tolist()       # 5 full pages + 7 tokens
    q1, q2 = (torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 12))
    other = torch.randint(0, model.cfg.vocab_size, (PAGE,), generator=g).tolist()
    c = doc[:2 * PAGE] + other + doc[3 * PAGE:] + q1
    kv = store(model.cfg, kind, layout, caching=True)
    serve(model, kv, "a", doc + q1, 3)
    kv.release("a")
    assert kv.cached_pages() == (len(doc + q1) + 3) // PAGE and kv.pages.pages_used == kv.cached_pages()
    for req, tokens, want in (("b", doc + q2, 5 * PAGE), ("c", c, 2 * PAGE)):
        got, start = serve(model, kv, req, tokens, 4)
        ref, _ = serve(model, store(model.cfg, kind, layout, caching=False), req, tokens, 4)
        assert start == want
        assert all(torch.equal(x, y) for x, y in zip(got, ref)), f"{req}: a hit changed the logits"
        kv.release(req)
    assert kv.stats.prefix_hits == 7 * PAGE
    assert kv.stats.prefix_queries == sum(len(t) - 1 for t in (doc + q1, doc + q2, c))
    assert kv.pages.pages_used == kv.cached_pages() and not kv.pages.refs
