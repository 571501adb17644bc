"""The DCP collectives of one layer (`DCPContext`) on real processes (gloo), against single-process references on
inputs built to hit their boundaries: the global top-k merge with ties across ranks, rows with fewer visible keys
than k, and a row with none; the LSE combine with empty shards and a query whose rows all live on one rank, with
replicated and split heads, in fp64 and bf16; the query all-gather of split heads. One spawn of 3 ranks covers
R = 1, 2, 3 (groups of its first R ranks) and interleaves 1 and 2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hisparse.kv.scoring import select_topk
from hisparse.parallel.context import DCPContext
from hisparse.parallel.group import RankGroup
from hisparse.parallel.launch import launch
from hisparse.parallel.sharding import Sharding

SIZES, INTERLEAVES = (1, 2, 3), (1, 2)
N, S, K, H_RANK, D = 6, 23, 5, 2, 4        # queries, positions, top-k, heads per rank, latent width
VISIBLE = (S, S, 12, 3, 0, S)              # keys each query sees: all, some, fewer than K, none
ONE_RANK = 5                               # the query whose selected rows all live on rank 0


def inputs(seed: int, R: int, I: int) -> dict:
    """The global data of one (R, I) case, the same in every process: indexer scores [N, S] (small integers, so
    ties span ranks; -inf past a query's visible keys) and attention logits [N, R h, S] (-inf outside Sel) with
    rows [S, D], fp64."""
    g = torch.Generator().manual_seed(seed * 100 + R * 10 + I)
    pos = torch.arange(S)
    scores = torch.randint(0, 4, (N, S), generator=g).double()
    scores[0] = pos % 3          # seven 2s for K = 5: a tie broken by position, across ranks when R > 1
    scores = scores.masked_fill(pos >= torch.tensor(VISIBLE)[:, None], float("-inf"))
    logits = torch.randn(N, R * H_RANK, S, generator=g, dtype=torch.float64) * 3
    owner = Sharding(R, I, 0).owner(pos)
    sel = torch.ones(N, S, dtype=torch.bool)
    sel[ONE_RANK] = owner == 0
    sel[ONE_RANK, 0] = sel[ONE_RANK, -1] = False      # (still rows on rank 0, none elsewhere)
    logits = logits.masked_fill(~sel[:, None, :], float("-inf"))
    return {"scores": scores, "logits": logits, "rows": torch.randn(S, D, generator=g, dtype=torch.float64),
            "queries": torch.randn(N, R * H_RANK, 3, generator=g)}


def partial(logits: torch.Tensor, rows: torch.Tensor, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(olat [N, H, D], lse [N, H]) of attention over the rows `mine` [S] selects; an empty shard: (0, -inf)."""
    part = logits.masked_fill(~mine, float("-inf"))
    lse = torch.logsumexp(part, dim=-1)
    p = torch.exp(part - lse[..., None]).nan_to_num(0.0)
    return p @ rows, lse


def rank_main(group: RankGroup, seed: int) -> dict:
    """Every rank: for each R, the ranks < R run merge_topk, gather_heads and combine on their own shard."""
    out = {}
    for R in SIZES:
        pg = dist.new_group(list(range(R)))          # every rank must call it
        if group.rank >= R:
            continue
        for I in INTERLEAVES:
            data = inputs(seed, R, I)
            for split in (False, True):
                dcp = DCPContext(RankGroup(pg, group.timeout_s), I, heads_split=split)
                mine = dcp.sharding.owner(torch.arange(S)) == group.rank
                owned = mine.nonzero().flatten()                          # global positions, ascending
                local = data["scores"][:, owned]
                cols = select_topk(local, K)                              # local top-k, -1 padded
                cols = torch.cat((cols, cols.new_full((N, K - cols.shape[1]), -1)), 1)
                where = owned[cols.clamp(min=0)].masked_fill(cols < 0, -1)
                sc = local.gather(1, cols.clamp(min=0)).masked_fill(cols < 0, float("-inf")).float()
                olat, lse = partial(data["logits"], data["rows"], mine)
                heads = slice(group.rank * H_RANK, (group.rank + 1) * H_RANK)
                x = data["queries"][:, heads] if split else data["queries"]
                case = {"sel": dcp.merge_topk(sc, where, K, 0), "heads": dcp.gather_heads(x, 0),
                        "same": dcp.gather_heads(x, 0) is x, "none": dcp.gather_heads(None, 0),
                        "combined": dcp.combine(olat, lse, 0),
                        "bf16": dcp.combine(olat.bfloat16(), lse.float(), 0)}
                out[(R, I, split)] = case
    return out


@pytest.fixture(scope="module")
def ranks(seed: int) -> tuple[int, list[dict]]:
    return seed, launch(rank_main, max(SIZES), seed, threads=1, timeout_s=60.0, deadline_s=300.0)


@pytest.mark.parametrize("R", SIZES)
@pytest.mark.parametrize("I", INTERLEAVES)
def test_merge_topk_is_the_single_rank_selection(ranks, R: int, I: int) -> None:
    seed, results = ranks
    data = inputs(seed, R, I)
    want = select_topk(data["scores"], K)       # single-rank Sel(t): score desc, position asc; ascending, -1 padded
    assert torch.equal(want[0], torch.tensor([2, 5, 8, 11, 14]))                  # the tie, broken by position
    assert (want[4] == -1).all() and (want[3, 3:] == -1).all() and (want[3, :3] >= 0).all()   # fewer than K, none
    for r in range(R):
        for split in (False, True):
            got = results[r][(R, I, split)]["sel"]
            assert got.dtype == torch.long and torch.equal(got, want), (r, split)


@pytest.mark.parametrize("R", SIZES)
@pytest.mark.parametrize("I", INTERLEAVES)
def test_combine_is_attention_over_every_rank(ranks, R: int, I: int) -> None:
    seed, results = ranks
    data = inputs(seed, R, I)
    olat, lse = partial(data["logits"], data["rows"], torch.ones(S, dtype=torch.bool))     # one rank holds all
    owner = Sharding(R, I, 0).owner(torch.arange(S))
    if R > 1:       # query ONE_RANK: ranks > 0 hold none of its rows
        assert all(torch.isinf(partial(data["logits"], data["rows"], owner == r)[1][ONE_RANK]).all()
                   for r in range(1, R))
    for r in range(R):
        for split in (False, True):
            case = results[r][(R, I, split)]
            heads = slice(r * H_RANK, (r + 1) * H_RANK) if split else slice(None)
            want = olat[:, heads]
            assert case["combined"].dtype == torch.float64 and case["combined"].shape == want.shape
            torch.testing.assert_close(case["combined"], want, rtol=1e-12, atol=1e-12)
            assert case["bf16"].dtype == torch.bfloat16
            torch.testing.assert_close(case["bf16"].double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("R", SIZES)
def test_gather_heads(ranks, R: int) -> None:
    seed, results = ranks
    data = inputs(seed, R, 1)
    for r in range(R):
        split, replicated = results[r][(R, 1, True)], results[r][(R, 1, False)]
        assert torch.equal(split["heads"], data["queries"]) and split["none"] is None
        assert replicated["same"] and torch.equal(replicated["heads"], data["queries"])
