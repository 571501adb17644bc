"""Indexer top-k selection time per prefill chunk vs context S: fused CPU kernel vs the torch path.

Inputs are real: layer 0's indexer of the random tiny model (max_position_embeddings 2^21) projects random
tokens, so queries, keys and head weights have the model's distributions (keys LayerNormed and rotated, SSMax on
queries). A chunk is the last --chunk queries of an S-token context, scored against all S keys.

The torch path (index_scores + select_topk) and the pre-kernel einsum formula (the seed's Indexer.scores, kept
here only as a timing baseline) are timed on --sample rows and scaled to the chunk (their cost per row is
linear); the fused path is timed on the whole chunk and must select exactly what the torch path selects for the
sampled rows. Wall seconds and process CPU seconds are both reported. Results -> JSON.

    python -m benchmarks.indexer.select [--contexts 65536,262144,1048576] [--chunk 4096] [--sample 32]
                                        [--out benchmarks/indexer/results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from hisparse.model.config import preset_params
from hisparse.model.indexer import Indexer, index_scores, select_topk
from hisparse.model.kernels import indexer_topk
from hisparse.model.rope import rope_cos_sin, rope_frequencies
from hisparse.model.tiny import random_model


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


@torch.no_grad()
def run(contexts: list[int], chunk: int, sample: int, seed: int = 0) -> list[dict]:
    params = preset_params("tiny")
    params["max_position_embeddings"] = 1 << 21
    model = random_model(params, seed)
    layer = model.layers[0]
    ix = layer.attention.indexer
    S_max = max(contexts)
    tokens = torch.randint(0, model.cfg.vocab_size, (S_max,), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(S_max)
    cos, sin = rope_cos_sin(rope_frequencies(model.cfg, model.lerope.alpha), positions, model.dtype)
    q, k, w = ix.project(layer.attention_norm(model.tok_embeddings(tokens)), positions, cos, sin)
    out = []
    for S in contexts:
        sl = slice(S - chunk, S)
        qc, wc, pc, keys = q[sl], w[sl], positions[sl], k[:S]
        wr = ix.head_weights(wc)
        fused, f_wall, f_cpu = timed(lambda: indexer_topk.fused_topk(qc, wr, keys, pc + 1, ix.topk)[0])
        rows = torch.linspace(0, chunk - 1, sample).long()
        ref, t_wall, t_cpu = timed(lambda: select_topk(index_scores(qc[rows], wr[rows], keys, pc[rows]), ix.topk))
        assert torch.equal(fused[rows], ref), f"S={S}: fused and torch selections differ"
        _, e_wall, e_cpu = timed(lambda: einsum_select(ix, qc[rows], wc[rows], keys, pc[rows]))
        scale = chunk / sample
        pairs = chunk * S - chunk * (chunk - 1) / 2
        res = {"context": S, "chunk": chunk, "pairs": pairs,
               "fused_wall_s": f_wall, "fused_cpu_s": f_cpu, "fused_ns_per_pair_cpu": f_cpu / pairs * 1e9,
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
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default="benchmarks/indexer/results.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    res = {"setup": {"model": "random tiny preset (HI=2, dI=16, k=8), layer 0 indexer, random tokens, seed 0",
                     "chunk": args.chunk, "sample_rows_torch": args.sample, "threads": args.threads,
                     "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
                     "load_average": list(os.getloadavg())},
           "results": run(contexts, args.chunk, args.sample)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
