"""How `TensorParallel` shards the tiny ML4 (every layer kind) on the meta device, rank by rank: each parameter it
splits has exactly its checkpoint region's shape and the ranks' regions tile the whole tensor in rank order; every
other parameter is replicated whole (the indexer, MLA's latent head, norms, the router), and each routed expert
lives on exactly one rank, whole. One rank shards nothing; ranks and sizes are checked at their boundaries."""

from __future__ import annotations

import re

import pytest
import torch

from hisparse.core.config import preset
from hisparse.model.ml4 import ML4
from hisparse.model.weights import region_shape
from hisparse.parallel.group import RankGroup
from hisparse.parallel.tp import TensorParallel, check_splits, shard_for

# the parameters tensor parallelism splits (the rest is replicated): (pattern, the dimension it splits)
SPLIT = ((r"^tok_embeddings\.weight$", 0), (r"^output\.weight$", 0),
         (r"\.attention\.(ssmax_scaling|wq\.weight|wkv_b\.weight)$", 0), (r"\.attention\.wo\.weight$", 1),
         (r"\.(feed_forward|shared_experts)\.w[13]\.weight$", 0), (r"\.(feed_forward|shared_experts)\.w2\.weight$", 1))
EXPERT = re.compile(r"\.experts\.(\d+)\.")


def split_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits `name` along; None: replicated (the DSpark drafter whole)."""
    if name.startswith("mtp_dspark."):
        return None
    return next((dim for pattern, dim in SPLIT if re.search(pattern, name)), None)


def meta_model():
    with torch.device("meta"):
        return ML4(preset("tiny"))


@pytest.mark.parametrize("size", [2, 4])
def test_regions_tile_every_split_tensor_and_the_rest_is_replicated(size: int) -> None:
    full = dict((n, tuple(p.shape)) for n, p in meta_model().named_parameters())
    E = len(meta_model().layers[1].moe.experts)
    tiles: dict[str, list[slice]] = {}
    owners: dict[str, int] = {}
    for rank in range(size):
        model = meta_model()
        select = TensorParallel(rank, size).shard(model)
        mine = dict((n, tuple(p.shape)) for n, p in model.named_parameters())
        for name, shape in full.items():
            region, dim = select(name, shape), split_dim(name)
            if m := EXPERT.search(name):                                         # a routed expert
                e = int(m.group(1))
                held = rank * E // size <= e < (rank + 1) * E // size
                assert (name in mine) == held and region is None, (name, rank)
                if held:
                    assert mine[name] == shape
                    owners[name] = owners.get(name, 0) + 1
                continue
            if dim is None:
                assert region is None and mine[name] == shape, name              # replicated whole
                continue
            assert region is not None and mine[name] == region_shape(region, shape), (name, rank)
            assert all(r == slice(None) for i, r in enumerate(region) if i != dim)
            tiles.setdefault(name, []).append(region[dim])
    assert set(owners) == {n for n in full if EXPERT.search(n)}
    assert set(owners.values()) == {1}                                           # each expert on one rank
    assert tiles.keys() == {n for n in full if split_dim(n) is not None}
    for name, parts in tiles.items():
        n = full[name][split_dim(name)]
        assert [(s.start, s.stop) for s in parts] == [(r * n // size, (r + 1) * n // size) for r in range(size)]


def test_one_rank_shards_nothing() -> None:
    model = meta_model()
    before = dict(model.named_parameters())
    assert TensorParallel(0, 1).shard(model) is None
    assert dict(model.named_parameters()) == before
    check_splits(preset("tiny"), 1)


def test_ranks_and_splits_are_checked() -> None:
    TensorParallel(1, 2)
    for rank, size in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match=f"tensor parallelism: rank {rank} of {size}"):
            TensorParallel(rank, size)
    check_splits(preset("tiny"), 4)
    with pytest.raises(ValueError, match=r"vocab_size \(512\) does not divide by 3"):
        check_splits(preset("tiny"), 3)


def test_no_tensor_parallelism_without_a_group_of_two(tmp_path) -> None:
    """The loader's shard hook: none without a group or for a group of one (a real one-rank gloo group)."""
    assert shard_for(None) is None
    group = RankGroup.init(0, 1, f"file://{tmp_path}/rendezvous")
    try:
        assert shard_for(group) is None
    finally:
        group.close()
