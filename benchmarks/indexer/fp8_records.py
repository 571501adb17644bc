"""The fused CPU indexer kernel over fp8 key records (decoded as it gathers them) vs over fp32 keys of the same
values: CPU seconds of one chunk of queries at the end of an S-token context, and identical selections.

    python -m benchmarks.indexer.fp8_records [--out benchmarks/results/indexer/fp8_records.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hisparse.kv.index_cache import dequantise, quantise
from hisparse.kv.kernels import indexer_topk

# (HI, dI, k, S, T): needle-ml4's indexer, and the full size's heads, dims and top-k at a shorter context
CASES = ((4, 32, 64, 65536, 1024), (32, 128, 2048, 16384, 256))


def cpu_seconds(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/indexer/fp8_records.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows = []
    for HI, dI, k, S, T in CASES:
        rec = quantise(torch.randn(S, dI, generator=g))
        keys = dequantise(rec, torch.float32)
        q, wr = torch.randn(T, HI, dI, generator=g), torch.rand(T, HI, generator=g) - 0.2
        table, seg, n_visible = torch.arange(S // 64).view(1, -1), torch.zeros(T, dtype=torch.long), \
            torch.arange(S - T + 1, S + 1)
        run = lambda kk: indexer_topk.fused_topk_paged(q, wr, kk, table, 64, seg, n_visible, k)[0]   # noqa: E731
        same = torch.equal(run(keys), run(rec))
        t32, t8 = cpu_seconds(lambda: run(keys)), cpu_seconds(lambda: run(rec))
        rows.append({"HI": HI, "dI": dI, "k": k, "S": S, "T": T, "fp32_keys_cpu_s": t32, "fp8_records_cpu_s": t8,
                     "ratio": t8 / t32, "same_selections": same})
        print(f"HI={HI} dI={dI} k={k} S={S:,} T={T}: fp32 keys {t32:.3f} CPU-s, fp8 records {t8:.3f} CPU-s "
              f"({t8 / t32:.2f}x), same selections: {same}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": 1, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
