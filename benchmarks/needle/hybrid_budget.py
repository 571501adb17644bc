"""Decode miss rate vs device budget under hybrid offload, with the passkey answers of the all-resident store.

For each haystack length and each budget (`--device-kv-gib` = one request's working set plus a fraction of its
pages as resident pages: 1.0 = nothing spilled, 0.0 = `--kv-offload hisparse`, everything through the hot buffers),
the same passkey prompts are
prefilled and greedy-decoded through needle-ml4 in process; per cell: the decode lookups' miss rate (misses /
(resident hits + hits + misses), decode steps only), and whether every answer equals the all-resident store's.
Writes JSON and a PNG.

    python -m benchmarks.needle.hybrid_budget --model checkpoints/needle-ml4 [--lengths 8000,32000]
        [--fractions 1,0.75,0.5,0.25,0.1,0] [--depths 0,25,50,75,100] [--out benchmarks/results/needle/hybrid]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hisparse.engine.generate import prefill
from hisparse.core.batch import Segment
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.kv.settings import KVSettings
from hisparse.model.tokenizer import load_tokenizer
from hisparse.model.weights import load_model
from hisparse.train.passkey import sample_prompt

MAX_TOKENS = 10
COUNTS = ("resident_hits", "hits", "misses")


def decode(model, kv, ids: list[int], eos: int) -> tuple[list[int], dict[str, int]]:
    """Greedy answer after a chunked prefill; the decode steps' lookups by kind (prefill excluded)."""
    try:
        logits = prefill(model, kv, 0, ids, chunk=1024)
        before = dataclasses.replace(kv.stats)
        out, pos = [], len(ids)
        for _ in range(MAX_TOKENS):
            tok = int(torch.argmax(logits))
            out.append(tok)
            if tok == eos or len(out) == MAX_TOKENS:
                break
            logits = model(torch.tensor([tok]), [Segment(0, pos, 1)], kv)[0]
            pos += 1
        return out, {k: getattr(kv.stats, k) - getattr(before, k) for k in COUNTS}
    finally:
        kv.release(0)


def settings_for(fraction: float, pages: int, probe: HiSparseKV) -> KVSettings:
    """The store of a budget cell: one request's working set and `fraction` of its `pages` as resident pages
    (0: always offload)."""
    n = round(fraction * pages)
    return KVSettings(offload="hybrid" if n else "hisparse", host_pool_gib=1.0, device_kv_gib=probe.budget_gib(1, n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/needle-ml4")
    ap.add_argument("--lengths", default="8000,32000", help="haystack characters (byte-level: about tokens)")
    ap.add_argument("--fractions", default="1,0.75,0.5,0.25,0.1,0")
    ap.add_argument("--depths", default="0,25,50,75,100")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results/needle/hybrid")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(Path(args.model))
    tok = load_tokenizer(Path(args.model)).instruct_tokenizer.tokenizer
    P = KVSettings().page_tokens
    probe = KVSettings(host_pool_gib=0.001).build(model.cfg)     # the default geometry's working set and pages
    lengths = [int(x) for x in args.lengths.split(",")]
    fractions = [float(x) for x in args.fractions.split(",")]
    depths = [float(x) / 100 for x in args.depths.split(",")]
    cells, t0 = [], time.time()
    bar = tqdm(total=len(lengths) * len(depths) * (len(fractions) + 1), unit="prompt")
    for chars in lengths:
        rng = random.Random(f"hybrid:{args.seed}:{chars}")
        prompts = [(tok.encode(text, bos=True, eos=False), value)
                   for text, value in (sample_prompt(rng, chars, d) for d in depths)]
        ref = []
        for ids, _ in prompts:
            ref.append(decode(model, KVSettings(offload="none").attach(model), ids, tok.eos_id)[0])
            bar.update()
        for f in fractions:
            counts, same, found = dict.fromkeys(COUNTS, 0), 0, 0
            for (ids, value), want in zip(prompts, ref):
                pages = -(-(len(ids) + MAX_TOKENS) // P)
                settings = settings_for(f, pages, probe)
                got, c = decode(model, settings.attach(model), ids, tok.eos_id)
                counts = {k: counts[k] + c[k] for k in COUNTS}
                same += got == want
                found += tok.decode(got).strip().rstrip(".").strip() == value
                bar.update()
            lookups = sum(counts.values())
            cells.append({"chars": chars, "tokens": sum(len(i) for i, _ in prompts) // len(prompts),
                          "resident_fraction": f, "device_kv_gib_last_prompt": settings.device_kv_gib,
                          "decode_lookups": counts,
                          "decode_miss_rate": counts["misses"] / lookups if lookups else 0.0,
                          "answers_identical": same, "found": found, "n": len(prompts)})
            bar.set_postfix(chars=chars, fraction=f, miss=f"{cells[-1]['decode_miss_rate']:.2f}")
    bar.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "hybrid decode miss rate vs device budget", "model": args.model,
              "command": "python -m benchmarks.needle.hybrid_budget " + " ".join(
                  f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "threads"),
              "page_tokens": P, "page_bytes": probe.page_bytes, "working_set_bytes": probe.working_set_bytes(), "wall_s": round(time.time() - t0, 1), "cells": cells,
              "all_answers_identical": all(c["answers_identical"] == c["n"] for c in cells)}
    (out / "hybrid_budget.json").write_text(json.dumps(result, indent=2))
    plot(cells, out / "hybrid_budget.png")
    for c in cells:
        print(f"{c['chars']:>7,} chars  resident {c['resident_fraction']:4.2f}  decode miss rate "
              f"{c['decode_miss_rate']:.3f}  answers identical {c['answers_identical']}/{c['n']}")
    print(f"wrote {out / 'hybrid_budget.json'}")


def plot(cells: list[dict], path: Path) -> None:
    from ..throughput.run import pyplot
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for chars in sorted({c["chars"] for c in cells}):
        pts = sorted((c["resident_fraction"], c["decode_miss_rate"]) for c in cells if c["chars"] == chars)
        ax.plot(*zip(*pts), "o-", label=f"{chars:,}-character haystack")
    ax.set_xlabel("device budget (fraction of the request's pages resident)")
    ax.set_ylabel("decode lookups that miss")
    differ = sum(c["answers_identical"] < c["n"] for c in cells)
    ax.set_title("needle-ml4, hybrid offload: answers identical to all-resident in " +
                 ("every cell" if not differ else f"all but {differ} cells"), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
