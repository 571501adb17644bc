"""One training step of needle-ml4's top-k-only forward (`hisparse.train.topk_forward`) at long lengths: seconds
and peak RSS per query chunk size, each configuration in a fresh process (peak RSS is per process); with
`--frozen`, a frozen-haystack step (`hisparse.train.prefix_forward`) beside each length, with the seconds its
round spends caching the haystack once.

    python -m benchmarks.needle.train_step [--model checkpoints/needle-ml4] [--chars 32768,131072] \\
        [--chunks 0,8192] [--frozen] [--threads 2] [--out benchmarks/results/needle/train_step.json]

A chunk of 0 is the one-piece forward (every query's gathered rows kept for the backward pass). The sequence is
one passkey prompt of the training task (`hisparse.train.passkey`) with its answer; the loss is the recipe's
(token CE + answer CE + indexer KL), so the step is the one `hisparse train-needle` takes, less the optimizer.
A frozen step trains the same loss on the live rows (needle, question, answer) of a haystack of the same length.
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
from tqdm import tqdm

from hisparse.model.weights import load_model
from hisparse.train.frozen_haystack import build_haystack
from hisparse.train.recipe import Recipe, Stage
from hisparse.train.topk_forward import topk_forward
from hisparse.train.trainer import PasskeyBatches, step_forward, step_loss

FROZEN = -1      # the `chunk` of a frozen-haystack configuration


def one_step(model_dir: Path, chars: int, chunk: int, threads: int) -> dict:
    """Forward and backward of one training step on a `chars`-character passkey sequence."""
    torch.set_num_threads(threads)
    model = load_model(model_dir).train()
    recipe = Recipe()
    if chunk == FROZEN:
        return frozen_step(model, model_dir, chars, threads, recipe)
    stage = Stage("bench", 1, chars, chars, True, 0.0, topk_only=True)
    tokens, ans, valid = PasskeyBatches(model_dir, 0).batch(stage, 1)
    t0 = time.perf_counter()
    logits, query_kl = topk_forward(model, tokens[:, :-1], recipe.kl_recent_keys, chunk or tokens.shape[1])
    loss, _ = step_loss(logits, tokens[:, 1:], ans, valid, query_kl.mean(1).mean(), recipe)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    return {"chars": chars, "tokens": tokens.shape[1], "query_chunk": chunk, "threads": threads,
            "forward_s": round(t1 - t0, 1), "backward_s": round(t2 - t1, 1), "loss": round(loss.item(), 4),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def frozen_step(model, model_dir: Path, chars: int, threads: int, recipe: Recipe) -> dict:
    """The haystack cache of a frozen stage's round, then forward and backward of one of its steps."""
    stage = Stage("bench", 1, chars, chars, True, 0.0, frozen=True, answer_kl=1.0)
    data = PasskeyBatches(model_dir, 0)
    t0 = time.perf_counter()
    hay = build_haystack(model, data.encode, 0, chars, recipe.kl_recent_keys)
    t1 = time.perf_counter()
    drawn, _ = data.draw(stage, 1)
    logits, targets, ans, valid, index_kl, (_, T) = step_forward(model, stage, drawn, data, recipe, hay)
    loss, _ = step_loss(logits, targets, ans, valid, index_kl, recipe)
    t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter()
    return {"chars": chars, "tokens": T, "frozen": True, "threads": threads, "cache_s": round(t1 - t0, 1),
            "forward_s": round(t2 - t1, 2), "backward_s": round(t3 - t2, 2), "loss": round(loss.item(), 4),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="checkpoints/needle-ml4")
    ap.add_argument("--chars", default="32768,131072")
    ap.add_argument("--chunks", default="0,8192", help="query chunk sizes; 0: one piece")
    ap.add_argument("--frozen", action="store_true", help="a frozen-haystack step at each length too")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/needle/train_step.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)       # chars,chunk: run one configuration, print its JSON
    args = ap.parse_args()
    if args.one:
        chars, chunk = map(int, args.one.split(","))
        print(json.dumps(one_step(Path(args.model), chars, chunk, args.threads)))
        return
    rows = []
    chunks = [*map(int, args.chunks.split(",")), *([FROZEN] if args.frozen else [])]
    configs = [(c, k) for c in map(int, args.chars.split(",")) for k in chunks]
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
