"""Indexer top-k selection time per prefill chunk vs context S: fused CPU kernel vs the torch path, and the
kernel's default build (widest SIMD lanes: 512-bit with AVX-512; the AMX tile filter where the CPU has AMX, else
the dot filter where it has AVX512_VNNI (int8) or AVX512_BF16 (bf16), else the FMA filter) vs builds without them.

Inputs are real: a layer's indexer projects a prompt, so queries, keys and head weights have the model's
distributions (keys LayerNormed and rotated, SSMax on queries). Default: layer 0 of the random tiny model
(max_position_embeddings 2^21) on random tokens; --model CKPT: a checkpoint (e.g. the trained
checkpoints/needle-ml4) on the synthetic needle haystack it was trained on. A chunk is the last --chunk queries
of an S-token context, scored against all S keys. Every build must select exactly the same keys.

The torch path (index_scores + select_topk) and the pre-kernel einsum formula (the seed's Indexer.scores, kept
here only as a timing baseline) are timed on --sample rows and scaled to the chunk (their cost per row is
linear); the fused path is timed on the whole chunk and must select exactly what the torch path selects for the
sampled rows. Wall seconds and process CPU seconds are both reported. With --repeat N the kernel's builds are
timed N times each, interleaved (one round = every build once), and the median time and the median of the
per-round ratios are reported: on a shared machine, ratios from one round compare like with like. Results -> JSON.

    python -m benchmarks.indexer.select [--contexts 65536,262144,1048576] [--chunk 4096] [--sample 32]
                                        [--repeat 1] [--model CKPT] [--out benchmarks/results/indexer/select.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from hisparse.core.config import preset_params
from hisparse.model.indexer import Indexer
from hisparse.kv.scoring import index_scores, select_topk
from hisparse.kv.kernels import indexer_topk
from hisparse.model.ml4 import ML4
from hisparse.model.tiny import random_model
from hisparse.model.weights import load_model
from hisparse.train.passkey import SyntheticHaystack

from benchmarks.needle.harness import needle_value
from benchmarks.needle.prompt import PromptBuilder
from benchmarks.needle.tokens import LocalCounter


BASELINES = {   # other builds of the kernel, timed against the default (widest lanes, AMX, dot or FMA filter)
    "256bit_unfiltered (the kernel before all filters)": indexer_topk.Build(vec_bytes=32, filter=False),
    "unfiltered": indexer_topk.Build(filter=False),
    "fma_filter (no tile or dot filter)": indexer_topk.FMA_FILTER,
}
if indexer_topk.has_amx():   # else the default build is this one
    BASELINES["dot_filter (no AMX)"] = indexer_topk.Build(amx=False)
if indexer_topk.full_row_filter(indexer_topk.Build(amx=False)) == "dot_int8" and \
        indexer_topk.full_row_filter(indexer_topk.DOT_BF16_FILTER) == "dot_bf16":   # int8 runs, bf16 too
    BASELINES["dot_bf16_filter (VDPBF16PS, no AMX)"] = indexer_topk.DOT_BF16_FILTER


def timed(fn) -> tuple[object, float, float]:
    """(result, wall seconds, process CPU seconds)."""
    c, w = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def einsum_select(ix: Indexer, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor
                  ) -> torch.Tensor:
    """The seed implementation's scoring (GEMM einsums; not bit-stable across shapes), for timing only."""
    dots = torch.relu_(torch.einsum("thd,sd->ths", q, keys))
    scores = torch.einsum("ths,th->ts", dots, ix.head_weights(w))
    s_idx = torch.arange(keys.shape[0])
    return select_topk(scores.masked_fill(s_idx[None, :] > pos[:, None], float("-inf")), ix.topk)


def prompt_tokens(model_dir: str | None, n: int, seed: int) -> tuple[ML4, torch.Tensor, str]:
    """(model, n prompt tokens, description): the random tiny model on random tokens, or a checkpoint on the
    synthetic needle haystack (needle at 50%)."""
    if model_dir is None:
        params = preset_params("tiny")
        params["max_position_embeddings"] = 1 << 21
        model = random_model(params, seed)
        tokens = torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
        return model, tokens, f"random tiny preset, random tokens, seed {seed}"
    counter = LocalCounter(model_dir)
    prompt = PromptBuilder(SyntheticHaystack(seed), counter, "completions").build(n, 0.5, needle_value(seed, n, 0.5))
    ids = counter.encode("completions", prompt.content)
    return load_model(model_dir), torch.tensor(ids), f"{model_dir}, synthetic needle haystack, seed {seed}"


@torch.no_grad()
def run(model: ML4, tokens: torch.Tensor, contexts: list[int], chunk: int, sample: int, repeat: int = 1
        ) -> list[dict]:
    layer = model.layers[0]   # layer 0: its input is the embedding, so no other layer need run
    ix = layer.attention.indexer
    S_max = max(contexts)
    positions = torch.arange(S_max)
    cos, sin = model.rope(positions)
    q, k, w = ix.project(layer.attention_norm(model.tok_embeddings(tokens)), positions, cos, sin)
    for build in [indexer_topk.Build(), *BASELINES.values()]:   # built before any timing
        indexer_topk.library(build)
    out = []
    for S in contexts:
        sl = slice(S - chunk, S)
        qc, wc, pc, keys = q[sl], w[sl], positions[sl], k[:S]
        wr = ix.head_weights(wc)
        times = {name: [] for name in ["default", *BASELINES]}   # (wall, cpu) per round
        fused = None
        for _ in range(repeat):
            for name, build in [("default", indexer_topk.Build()), *BASELINES.items()]:
                cols, wall, cpu = timed(lambda: indexer_topk.fused_topk(qc, wr, keys, pc + 1, ix.topk,
                                                                        build=build)[0])
                fused = cols if fused is None else fused
                assert torch.equal(fused, cols), f"S={S}: the {name} build selects differently"
                times[name].append((wall, cpu))
        f_wall = statistics.median(w for w, _ in times["default"])
        f_cpu = statistics.median(c for _, c in times["default"])
        builds = {}
        for name in BASELINES:
            rounds = [c / d for (_, c), (_, d) in zip(times[name], times["default"])]
            builds[name] = {"wall_s": statistics.median(w for w, _ in times[name]),
                            "cpu_s": statistics.median(c for _, c in times[name]),
                            "default_speedup_cpu": statistics.median(rounds), "default_speedup_cpu_rounds": rounds}
        rows = torch.linspace(0, chunk - 1, sample).long()
        ref, t_wall, t_cpu = timed(lambda: select_topk(index_scores(qc[rows], wr[rows], keys, pc[rows]), ix.topk))
        assert torch.equal(fused[rows], ref), f"S={S}: fused and torch selections differ"
        _, e_wall, e_cpu = timed(lambda: einsum_select(ix, qc[rows], wc[rows], keys, pc[rows]))
        scale = chunk / sample
        pairs = chunk * S - chunk * (chunk - 1) / 2
        res = {"context": S, "chunk": chunk, "pairs": pairs, "repeat": repeat,
               "fused_wall_s": f_wall, "fused_cpu_s": f_cpu, "fused_ns_per_pair_cpu": f_cpu / pairs * 1e9,
               "other_builds": builds,
               "torch_wall_s_projected": t_wall * scale, "torch_cpu_s_projected": t_cpu * scale,
               "einsum_seed_wall_s_projected": e_wall * scale, "einsum_seed_cpu_s_projected": e_cpu * scale,
               "speedup_vs_torch_cpu": t_cpu * scale / f_cpu, "speedup_vs_einsum_seed_cpu": e_cpu * scale / f_cpu}
        print(json.dumps(res), flush=True)
        out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="65536,262144,1048576")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--sample", type=int, default=32, help="rows timed on the torch paths (then scaled)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the kernel builds' timings (medians)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the random tiny model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/indexer/select.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    model, tokens, what = prompt_tokens(args.model, max(contexts), args.seed)
    c = model.cfg
    res = {"setup": {"model": f"{what}; layer 0 indexer (HI={c.index_n_heads}, dI={c.index_head_dim}, "
                              f"k={c.index_topk})", "simd_bits": 8 * indexer_topk.vec_bytes(),
                     "default_filter": indexer_topk.full_row_filter(),
                     "chunk": args.chunk, "sample_rows_torch": args.sample, "threads": args.threads,
                     "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
                     "load_average": list(os.getloadavg())},
           "results": run(model, tokens, contexts, args.chunk, args.sample, args.repeat)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
