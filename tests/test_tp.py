"""Tensor + expert parallelism, with DCP inside the TP group, on real processes (gloo): TP ranks each load only
their share of a checkpoint and give the single-rank selections, logits and greedy tokens, HiSparse on.

One spawn of 4 ranks runs TP x DCP in {2 x 1, 2 x 2, 4 x 1, 4 x 2, 4 x 4} (its first TP ranks; DCP groups are
consecutive blocks of the TP group) over test_dcp's scenario on the tiny preset: prefill, chunked prefill batched
with decode, batched decode and 64 greedy tokens, over every layer kind (MoE and the dense layer 0, NoPE layers,
indexer sharers, the KV-consumer layer 7). fp64 on a sharpened model checks selections and tokens exactly; fp32
on the spec-init model checks the reassociation tolerance (see test_dcp's docstring for why two models).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import SEED, tiny_model
from hisparse.parallel.context import DCPContext
from hisparse.parallel.group import RankGroup, backend_for
from hisparse.parallel.sharded_kv import ShardedKV
from hisparse.parallel.launch import launch
from hisparse.kv.resident import ResidentKV
from hisparse.model.weights import load_model, save_model
from hisparse.parallel.tp import shard_for
from test_dcp import GREEDY, hisparse_kv, rel_error, scenario

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = ((2, 1), (2, 2), (4, 1), (4, 2), (4, 4))   # (TP, DCP)
# tensors every rank holds whole: MLA's latent head, norms, the indexer, the router, LeRoPE, the drafter
REPLICATED = re.compile(r"(norm|wkv_a_with_mqa|indexer|\.gate\.|lerope|^mtp_dspark\.)")


def stores(model, name: str):
    return hisparse_kv(model) if name == "fp64" else ResidentKV(model.cfg, None, dtype=torch.float32)


def run(ckpts: dict[str, Path], shard, wrap, seed: int) -> dict:
    out = {}
    for name, (path, dtype) in ckpts.items():
        model = load_model(path, dtype=dtype, shard=shard, progress=False)
        out[name] = scenario(model, wrap(stores(model, name)), seed, GREEDY if name == "fp64" else 0)
        out[name]["params"] = {n: (tuple(p.shape), p.dtype, p.numel() * p.element_size())
                               for n, p in model.named_parameters()}
    return out


def rank_main(group: RankGroup, ckpts: dict[str, Path], seed: int) -> dict:
    results = {}
    for tp, dcp in CONFIGS:
        if group.rank >= tp:
            continue
        tp_group = group.subgroup(tp)
        dcp_group = tp_group.subgroup(dcp)
        ctx = DCPContext(dcp_group, 1, heads_split=True)
        results[(tp, dcp)] = run(ckpts, shard_for(tp_group), (lambda kv: ShardedKV(kv, ctx)) if dcp > 1 else
                                 (lambda kv: kv), seed)
    return results


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory) -> tuple[dict, list[dict]]:
    root = tmp_path_factory.mktemp("tp")
    ckpts = {"fp64": (root / "fp64", torch.float64), "fp32": (root / "fp32", torch.float32)}
    save_model(tiny_model(SEED), ckpts["fp64"][0])
    save_model(tiny_model(SEED, torch.float32, sharp=False), ckpts["fp32"][0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ref = run(ckpts, None, lambda kv: kv, SEED)
    torch.set_num_threads(threads)
    return ref, launch(rank_main, 4, ckpts, SEED, threads=1, timeout_s=60.0, deadline_s=900.0)


@pytest.mark.parametrize("tp, dcp", CONFIGS)
def test_tp_matches_single_rank(tp_runs, tp: int, dcp: int):
    refs, ranks = tp_runs
    ref, got = refs["fp64"], ranks[0][(tp, dcp)]["fp64"]
    for step, (want, have) in enumerate(zip(ref["selections"], got["selections"], strict=True)):
        assert sorted(have) == sorted(want) == list(range(8))
        for layer in want:
            for w, h in zip(want[layer], have[layer], strict=True):
                assert torch.equal(w, h), f"TP {tp} DCP {dcp} step {step} layer {layer}: selection differs"
    err, err32 = rel_error(ref, got), rel_error(refs["fp32"], ranks[0][(tp, dcp)]["fp32"])
    print(f"TP={tp} DCP={dcp}: max relative logit error fp64 {err:.2e}, fp32 {err32:.2e}")
    assert err < 1e-12 and err32 < 1e-5
    assert got["greedy"] == ref["greedy"] and len(got["greedy"]) == GREEDY
    for r in range(tp):   # every rank ends with the same logits (all-reduced / all-gathered), and used its pool
        mine = ranks[r][(tp, dcp)]
        assert all(torch.equal(x, y) for x, y in zip(mine["fp64"]["logits"], got["logits"], strict=True))
        assert mine["fp64"]["misses"] > 0


def wrong_device(group: RankGroup) -> str:
    """A group whose collectives run on another device than the tensor handed to it refuses the tensor."""
    other = RankGroup(group.pg, group.timeout_s, "meta")
    with pytest.raises(ValueError, match=r"all_reduce for a test tensor: tensor on cpu, the group's collectives run "
                                         r"on meta"):
        other.all_reduce(torch.ones(2), "a test tensor")
    return group.all_reduce(torch.ones(2), "a test tensor").tolist()


def test_collectives_check_the_device_and_the_backend_follows_it() -> None:
    """Every collective checks that its tensor lives on the group's device (so a CPU tensor never reaches NCCL;
    every TP/DCP test here runs through that check), and the backend follows the device, not the machine."""
    assert launch(wrong_device, 2, timeout_s=30.0, deadline_s=120.0) == [[2.0, 2.0]] * 2
    assert backend_for("cuda:1") == "nccl" and backend_for("cpu") == backend_for(torch.device("cpu")) == "gloo"


@pytest.mark.parametrize("tp", (2, 4))
def test_each_rank_holds_its_share_of_the_parameters(tp_runs, tp: int):
    """Replicated tensors whole on every rank; every other tensor split into equal, disjoint shares (routed
    experts whole on one rank each), so a rank's bytes are the replicated bytes + 1/TP of the rest."""
    refs, ranks = tp_runs
    full = refs["fp32"]["params"]
    per_rank = [ranks[r][(tp, 1)]["fp32"]["params"] for r in range(tp)]
    replicated = {n for n in full if REPLICATED.search(n)}
    assert replicated and len(replicated) < len(full)
    split_bytes = sum(full[n][2] for n in full if n not in replicated)
    rep_bytes = sum(full[n][2] for n in replicated)
    for r, params in enumerate(per_rank):
        assert {n for n in params if n in replicated} == replicated
        assert all(params[n] == full[n] for n in replicated)
        assert sum(b for _, _, b in params.values()) == rep_bytes + split_bytes // tp, f"rank {r}"
    for n in full:
        if n in replicated:
            continue
        held = [params[n][0] for params in per_rank if n in params]
        if ".experts." in n:      # a routed expert: whole, on exactly one rank
            assert held == [full[n][0]], n
        else:                     # a split tensor: every rank a 1/TP slice of one dimension
            assert len(held) == tp, n
            dims = [d for d in range(len(full[n][0])) if held[0][d] != full[n][0][d]]
            assert len(dims) == 1 and all(h[dims[0]] * tp == full[n][0][dims[0]] for h in held), n
