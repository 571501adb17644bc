"""Teacher-forced needles in one cached haystack (`hisparse.train.prefix_forward`), no training: per needle the
answer's mean cross-entropy, whether every answer token (EOS included) is the argmax, whether the ones before the
first miss spell the value (the needle copied, as `benchmarks.needle` grades a reply), the first miss, and the
answer queries' indexer KL. The haystack is cached once (as a frozen-haystack round caches it), so one
long length costs one prefill plus ~1 s a needle, where `benchmarks.needle.million` costs a prefill a prompt.

    python -m benchmarks.needle.frozen_eval --model checkpoints/needle-ml4 --chars 262144 [--needles 8] \\
        [--haystack-seed 12345] [--seed 1] [--threads 1] [--out benchmarks/results/needle/frozen_eval.json]

The rows are the training forward's (the answer's queries attend over Sel(t) plus the recipe's newest keys), so
an exact row is a teacher-forced answer, not a served one.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
from tqdm import tqdm

from hisparse.model.tokenizer import load_tokenizer
from hisparse.model.weights import load_model
from hisparse.train.frozen_haystack import build_haystack, live_needle
from hisparse.train.passkey import random_value
from hisparse.train.prefix_forward import prefix_forward
from hisparse.train.recipe import Recipe

KEEP = SpecialTokenPolicy.KEEP     # an EOS is named, not dropped


def evaluate(model_dir: Path, chars: int, needles: int, haystack_seed: int, seed: int) -> dict:
    """Cache one haystack of `chars` characters, then score `needles` needles (depth and value from `seed`)."""
    model = load_model(model_dir).eval()
    tok, recipe = load_tokenizer(model_dir).instruct_tokenizer.tokenizer, Recipe()
    t0 = time.perf_counter()
    with torch.no_grad():
        hay = build_haystack(model, tok.encode, haystack_seed, chars, recipe.kl_recent_keys)
        cache_s = time.perf_counter() - t0
        rng, rows = random.Random(seed), []
        for _ in tqdm(range(needles), desc=f"needles at {hay.cache.tokens.numel():,} tokens"):
            depth, value = rng.random(), random_value(rng)
            live = live_needle(hay, tok.encode, tok.eos_id, value, depth)
            logits, query_kl = prefix_forward(model, hay.cache, live.tokens, live.after, live.positions,
                                              recipe.kl_recent_keys)
            want, got = live.targets[live.ans], logits[live.ans].argmax(-1)
            wrong = (got != want).nonzero().flatten().tolist()
            right = tok.decode(want[:wrong[0] if wrong else None].tolist(), KEEP)   # the answer up to its first miss
            rows.append({"depth": round(depth, 3), "value": value,
                         "answer_ce": round(F.cross_entropy(logits[live.ans], want).item(), 4),
                         "exact": not wrong, "copied": value in right,
                         "first_wrong": None if not wrong else {"index": wrong[0], "of": want.numel(),
                                                                "want": tok.decode([int(want[wrong[0]])], KEEP),
                                                                "got": tok.decode([int(got[wrong[0]])], KEEP)},
                         "answer_index_kl": round(query_kl[:, live.ans].mean().item(), 4)})
            tqdm.write(json.dumps(rows[-1]))
    return {"tokens": hay.cache.tokens.numel(), "chars": chars, "haystack_seed": haystack_seed, "seed": seed,
            "cache_s": round(cache_s, 1), "exact": sum(r["exact"] for r in rows),
            "copied": sum(r["copied"] for r in rows), "needles": needles,
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="checkpoints/needle-ml4")
    ap.add_argument("--chars", type=int, default=262144)
    ap.add_argument("--needles", type=int, default=8)
    ap.add_argument("--haystack-seed", type=int, default=12345)
    ap.add_argument("--seed", type=int, default=1, help="the needles' depths and values")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/needle/frozen_eval.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = evaluate(Path(args.model), args.chars, args.needles, args.haystack_seed, args.seed)
    command = " ".join(["python -m benchmarks.needle.frozen_eval", *sys.argv[1:]])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": command, "model": args.model, "threads": args.threads,
                                          **result}, indent=1) + "\n")
    print(f"{result['exact']}/{result['needles']} exact, {result['copied']} with the value copied, at "
          f"{result['tokens']:,} tokens "
          f"(cache {result['cache_s']} s)")


if __name__ == "__main__":
    main()
