"""Chunked prefill that computes only the rows needing logits from the last cache-writing layer on, against one
that computes every row (what ML4.forward did before; a traced forward still does): CPU seconds and the ratio.

From `ML4.last_writer` on, nothing reads a row that needs no logits, so those layers run one row per prefill chunk
instead of every row; in prefill their indexer top-k (quadratic in the context) is what that saves. The two runs
go chunk by chunk on two KV stores, alternating which goes first, so a busy machine slows both alike; the final
chunk's logits of the two must agree (same greedy token). Models and prompts as in benchmarks.indexer.select:
the random tiny model on random tokens, or --model CKPT (e.g. checkpoints/needle-ml4) on the needle haystack.

    python -m benchmarks.indexer.rows [--model CKPT] [--tokens 32768] [--chunk 1024] [--threads 1]
                                      [--out benchmarks/results/indexer/rows.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch
from tqdm import tqdm

from hisparse.core.batch import ForwardTrace, Segment
from hisparse.kv.resident import ResidentKV

from benchmarks.indexer.select import prompt_tokens, timed


@torch.no_grad()
def run(model_dir: str | None, tokens: int, chunk: int, seed: int) -> dict:
    model, ids, what = prompt_tokens(model_dir, tokens, seed)
    kv = {"every_row": ResidentKV(model.cfg, dtype=model.dtype), "logit_rows": ResidentKV(model.cfg, dtype=model.dtype)}
    cpu = {mode: 0.0 for mode in kv}
    last = {}
    for i, s in enumerate(tqdm(range(0, tokens, chunk), desc=f"prefill {tokens} tokens", unit="chunk")):
        n, seg = min(chunk, tokens - s), [Segment(0, s, min(chunk, tokens - s))]
        at = torch.tensor([n - 1])
        runs = {"every_row": lambda: model(ids[s:s + n], seg, kv["every_row"], trace=ForwardTrace())[at],
                "logit_rows": lambda: model(ids[s:s + n], seg, kv["logit_rows"], logits_at=at)}
        for mode in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            last[mode], _, c = timed(runs[mode])
            cpu[mode] += c
    ref, got = last["every_row"], last["logit_rows"]
    c = model.cfg
    return {"model": what, "layers": c.n_layers, "last_writer": model.last_writer, "tokens": tokens, "chunk": chunk,
            "cpu_s": cpu, "speedup_cpu": cpu["every_row"] / cpu["logit_rows"],
            "final_logits_max_rel_diff": float((got - ref).abs().max() / ref.abs().max()),
            "same_greedy_token": bool(torch.equal(got.argmax(-1), ref.argmax(-1)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the random tiny model)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/indexer/rows.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = run(args.model, args.tokens, args.chunk, args.seed)
    res["setup"] = {"threads": args.threads, "torch": torch.__version__, "cpu": platform.processor() or
                    platform.machine(), "load_average": list(os.getloadavg())}
    assert res["same_greedy_token"], "the two prefills disagree on the next token"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
