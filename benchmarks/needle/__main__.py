"""`python -m benchmarks.needle`: needle-in-a-haystack over any OpenAI-compatible endpoint.

    python -m benchmarks.needle --base-url http://127.0.0.1:8000/v1 --lengths 8k,32k,128k \\
        --depths 0,25,50,75,100 [--compare-base-url URL] [--seeds 3] [--tokenizer CKPT_DIR] [--out DIR]

Writes DIR/needle.json (every request and the per-cell table) and DIR/needle.png (depth x length heatmaps),
shows a progress bar of requests and, read from each server's /metrics, one of prefilled prompt tokens with an ETA
(a million-token request answers after many minutes), and prints one summary line. DIR/records.jsonl gets each
record as it finishes, so a stopped run continues with --resume.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from hisparse.train.passkey import SyntheticHaystack

from .corpus import Corpus
from .harness import (Endpoint, cell_table, parse_depths, parse_lengths, record_json, resolve_lengths, run_grid,
                      summarize, summary_line)
from .plot import heatmap

from .prompt import PromptBuilder
from .tokens import LocalCounter, ServerCounter


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.needle", description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", required=True, help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    ap.add_argument("--compare-base-url", default=None, help="second endpoint: per cell, are the outputs identical")
    ap.add_argument("--compare-model", default=None)
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    ap.add_argument("--lengths", default="8k,32k,128k",
                    help="prompt lengths in tokens (k = 1024; 'max' = the server's limit); clipped to the limit")
    ap.add_argument("--depths", default="0,25,50,75,100", help="needle depths, percent of the haystack")
    ap.add_argument("--seeds", type=int, default=3, help="needles (passkeys) per cell")
    ap.add_argument("--haystack", choices=("corpus", "synthetic"), default="corpus",
                    help="corpus: prose from the installed software (one stream); synthetic: the seeded sentences "
                         "`hisparse train-needle` trains on, a fresh stream per seed")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--api", choices=("chat", "completions"), default="chat")
    ap.add_argument("--tokenizer", default=None,
                    help="served checkpoint dir (or its tekken.json) for exact token counts; default: count with "
                         "the server's /v1/completions usage (lengths then within a few tokens)")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight per endpoint")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    ap.add_argument("--out", default="benchmarks/results/needle", help="output folder")
    ap.add_argument("--prefill-bar", type=float, default=5.0, metavar="SECONDS",
                    help="poll each server's /metrics this often for a prefill progress bar with an ETA (0: off)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the records OUT/records.jsonl already holds (a stopped run) and ask only the rest")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.seeds < 1 or args.max_tokens < 1 or args.concurrency < 1:
        raise SystemExit("--seeds, --max-tokens and --concurrency must be >= 1")
    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    endpoints = [Endpoint.connect("base", args.base_url, args.model, args.api_key, args.timeout)]
    if args.compare_base_url:
        endpoints.append(Endpoint.connect("compare", args.compare_base_url, args.compare_model, args.api_key,
                                          args.timeout))
    limits = [ep.max_model_len for ep in endpoints if ep.max_model_len]
    grid = resolve_lengths(lengths, min(limits) if limits else None, args.max_tokens)
    counter = LocalCounter(args.tokenizer) if args.tokenizer else ServerCounter(endpoints[0].client,
                                                                               endpoints[0].model)
    names = [ep.name for ep in endpoints]
    if args.haystack == "corpus":
        corpus = Corpus()
        shared = PromptBuilder(corpus, counter, args.api)
        builder_for = lambda seed: shared   # noqa: E731
    else:   # a fresh synthetic haystack per seed (the passkey model's training distribution)
        builders: dict[int, PromptBuilder] = {}
        builder_for = lambda seed: builders.setdefault(   # noqa: E731
            seed, PromptBuilder(SyntheticHaystack(seed), counter, args.api))
    out = Path(args.out)
    t0 = time.perf_counter()
    records, resumed = run_grid(builder_for, endpoints, grid, depths, args.seeds, args.max_tokens,
                                args.concurrency, out / "records.jsonl", args.resume, args.prefill_bar)
    summary = summarize(records, names, time.perf_counter() - t0)
    summary["resumed"] = resumed
    cells = cell_table(records, names)
    result = {
        "benchmark": "needle", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks.needle", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "endpoints": {ep.name: {"url": ep.url, "model": ep.model, "max_model_len": ep.max_model_len}
                      for ep in endpoints},
        "config": {"api": args.api, "lengths": dict(grid), "depths": depths, "seeds": args.seeds,
                   "max_tokens": args.max_tokens, "temperature": 0,
                   "token_counts": "local tokenizer " + args.tokenizer if args.tokenizer else "server usage"},
        "haystack": ({"kind": "corpus", "documents_read": len(corpus.sources()), "repeats": corpus.cycles}
                     if args.haystack == "corpus" else {"kind": "synthetic", "streams": "one per seed"}),
        "summary": summary, "cells": cells, "records": [record_json(r) for r in records],
    }
    (out / "needle.json").write_text(json.dumps(result, indent=1))
    heatmap(cells, names, out / "needle.png",
            f"needle in a haystack: {endpoints[0].model} at {endpoints[0].url}"
            + (f" vs {endpoints[1].url}" if len(endpoints) == 2 else "") + f", {args.seeds} seed(s) per cell")
    print(summary_line(summary, names) + f" | {out / 'needle.json'}, {out / 'needle.png'}", flush=True)
    return result


if __name__ == "__main__":
    main()
