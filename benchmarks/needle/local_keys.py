"""Which indexer owner's missing nearby keys break a needle model's copy at long prompts: teacher-forced answers on
the needle benchmark's prompts, plain and with one owner's `recent` newest keys added to its Sel(t) at the answer
queries (`topk_forward`'s `widened` ablation).

    python -m benchmarks.needle.local_keys --model checkpoints/needle-ml4-long --tokens 131072 \\
        --cells 0:0,0:100,1:25,1:75,3:25,3:100,0:25,0:50 --layers 2 --out FILE.json

A cell is seed:depth% of `python -m benchmarks.needle --haystack synthetic --api completions` with the model's
tokenizer: the same prompt and passkey, so a plain answer here is the one `hisparse serve` gives (greedy decoding
is exact iff every answer token is the argmax after the right prefix, which is what teacher forcing checks). The
margin is the smallest, over the answer tokens, of the right token's logit minus the best other one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hisparse.model.weights import load_model
from hisparse.train.passkey import SyntheticHaystack, answer
from hisparse.train.recipe import Recipe
from hisparse.train.topk_forward import newest_missing, topk_forward

from .harness import needle_value
from .prompt import PromptBuilder
from .tokens import LocalCounter


NEWEST = 8   # the newest keys whose absence from Sel(t) a plain row reports


def answer_check(model, tokens: list[int], n: int, widened: dict[int, int], tok) -> dict:
    """Teacher-forced prediction of tokens[n:] after the prompt tokens[:n], with `widened` owners; without any,
    also each owner's mean count of its NEWEST newest keys missing from Sel(t), at the answer queries and at the
    prompt's queries."""
    kept = {}
    with torch.no_grad():
        logits, _ = topk_forward(model, torch.tensor([tokens[:-1]]), Recipe().kl_recent_keys, widened=widened,
                                 kept=kept)
    lg, want = logits[n - 1:], torch.tensor(tokens[n:])
    right = lg.gather(1, want[:, None])[:, 0]
    other = lg.scatter(1, want[:, None], float("-inf")).max(1).values
    pred = lg.argmax(-1)
    row = {"answer": tok.decode(pred.tolist()), "exact": bool((pred == want).all()),
           "margin": round((right - other).min().item(), 3)}
    if not widened:
        missing = {layer: newest_missing(c, NEWEST).float() for layer, c in kept.items()}
        row[f"newest_{NEWEST}_missing"] = {
            "answer": {str(layer): round(m[n - 1:].mean().item(), 2) for layer, m in missing.items()},
            "prompt": {str(layer): round(m[:n - 1].mean().item(), 3) for layer, m in missing.items()}}
    return row


def cell_prompt(counter: LocalCounter, seed: int, tokens: int, depth_pct: int) -> tuple[list[int], str]:
    """The prompt ids and passkey of one needle-benchmark cell (synthetic haystack, completions API)."""
    value = needle_value(seed, tokens, depth_pct / 100)
    p = PromptBuilder(SyntheticHaystack(seed), counter, "completions").build(tokens, depth_pct / 100, value)
    return counter.encode("completions", p.content), value


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="checkpoints/needle-ml4-long")
    ap.add_argument("--tokens", type=int, default=131072, help="prompt tokens (the needle benchmark's length)")
    ap.add_argument("--cells", default="0:0,0:100", help="seed:depth%% pairs, comma-separated")
    ap.add_argument("--layers", default="2", help="indexer owner layers to widen, one at a time ('': plain only)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cells = [(int(s), int(d)) for s, d in (c.split(":") for c in args.cells.split(","))]
    layers = [int(x) for x in args.layers.split(",") if x]
    model = load_model(args.model).eval()
    if not set(layers) <= set(model.cfg.index_owner_layers):
        raise SystemExit(f"--layers: {layers} are not all indexer owners {model.cfg.index_owner_layers}")
    counter = LocalCounter(args.model)
    tok = counter.text
    rows, t0 = [], time.perf_counter()
    bar = tqdm(total=len(cells) * (1 + len(layers)), desc="local keys", unit="forward")
    for seed, depth in cells:
        prompt, value = cell_prompt(counter, seed, args.tokens, depth)
        tokens = prompt + tok.encode(answer(value), bos=False, eos=False) + [tok.eos_id]
        row = {"seed": seed, "depth_pct": depth, "value": value, "prompt_tokens": len(prompt),
               "plain": answer_check(model, tokens, len(prompt), {}, tok)}
        bar.update()
        for layer in layers:
            row[f"recent_keys_at_owner_{layer}"] = answer_check(model, tokens, len(prompt), {layer: len(prompt) - 1},
                                                                tok)
            bar.update()
        rows.append(row)
        tqdm.write(json.dumps(row))
    bar.close()
    result = {"benchmark": "needle.local_keys", "model": args.model, "tokens": args.tokens,
              "recent_keys": Recipe().kl_recent_keys, "threads": args.threads,
              "command": "python -m benchmarks.needle.local_keys " + " ".join(argv or sys.argv[1:]),
              "wall_s": round(time.perf_counter() - t0, 1), "cells": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
