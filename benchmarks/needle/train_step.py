"""One training step of needle-ml4's top-k-only forward (`hisparse.train.topk_forward`) at long lengths: seconds
and peak RSS per query chunk size, each configuration in a fresh process (peak RSS is per process).

    python -m benchmarks.needle.train_step [--model checkpoints/needle-ml4] [--chars 32768,131072] \\
        [--chunks 0,8192] [--threads 2] [--out benchmarks/results/needle/train_step.json]

A chunk of 0 is the one-piece forward (every query's gathered rows kept for the backward pass). The sequence is
one passkey prompt of the training task (`hisparse.train.passkey`) with its answer; the loss is the recipe's
(token CE + answer CE + indexer KL), so the step is the one `hisparse train-needle` takes, less the optimizer.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from hisparse.model.weights import load_model
from hisparse.train.recipe import Recipe, Stage
from hisparse.train.topk_forward import topk_forward
from hisparse.train.trainer import PasskeyBatches


def one_step(model_dir: Path, chars: int, chunk: int, threads: int) -> dict:
    """Forward and backward of one training step on a `chars`-character passkey sequence."""
    torch.set_num_threads(threads)
    model = load_model(model_dir).train()
    recipe = Recipe()
    stage = Stage("bench", 1, chars, chars, True, 0.0, topk_only=True)
    tokens, ans, valid = PasskeyBatches(model_dir, 0).batch(stage, 1)
    t0 = time.perf_counter()
    logits, query_kl = topk_forward(model, tokens[:, :-1], recipe.kl_recent_keys, chunk or tokens.shape[1])
    index_kl = query_kl.mean(1).mean()
    ce = F.cross_entropy(logits, tokens[:, 1:].flatten(), reduction="none").view(ans.shape)
    loss = ce[valid].mean() + recipe.answer_weight * ce[ans].mean() + recipe.index_weight * index_kl
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    return {"chars": chars, "tokens": tokens.shape[1], "query_chunk": chunk, "threads": threads,
            "forward_s": round(t1 - t0, 1), "backward_s": round(t2 - t1, 1), "loss": round(loss.item(), 4),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="checkpoints/needle-ml4")
    ap.add_argument("--chars", default="32768,131072")
    ap.add_argument("--chunks", default="0,8192", help="query chunk sizes; 0: one piece")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/needle/train_step.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)       # chars,chunk: run one configuration, print its JSON
    args = ap.parse_args()
    if args.one:
        chars, chunk = map(int, args.one.split(","))
        print(json.dumps(one_step(Path(args.model), chars, chunk, args.threads)))
        return
    rows = []
    configs = [(c, k) for c in map(int, args.chars.split(",")) for k in map(int, args.chunks.split(","))]
    for chars, chunk in tqdm(configs, desc="train steps"):
        run = subprocess.run([sys.executable, "-m", "benchmarks.needle.train_step", "--model", args.model,
                              "--threads", str(args.threads), "--one", f"{chars},{chunk}"],
                             capture_output=True, text=True)
        if run.returncode:       # (a one-piece step past the machine's memory is killed: recorded as such)
            rows.append({"chars": chars, "query_chunk": chunk, "threads": args.threads,
                         "failed": f"exit {run.returncode}: {run.stderr.strip()[-300:]}"})
        else:
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
        tqdm.write(json.dumps(rows[-1]))
    command = " ".join(["python -m benchmarks.needle.train_step", *sys.argv[1:]])
    Path(args.out).write_text(json.dumps({"command": command, "model": args.model, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
