"""What crowds the newest keys out of a layer's selection while a passkey answer is decoded.

    python -m benchmarks.needle.distances --model DIR [--chars 128000] [--samples 4] [--layer 2] \\
        [--out benchmarks/results/needle/distances.json]

For fresh passkey prompts (the trainer's format, depths spread over [0, 1], each with its own random haystack),
greedy decoding through HiSparse (128 hot slots) records, at every answer step, how many of the 16 newest keys
`--layer`'s top-k holds and the distance (query position - key position) of every selected key further away.
A distance picked in several prompts, whose haystacks differ, is picked for where it is, not for what it holds:
the query's RoPE phases nearly repeat there. The result lists the distances (of at least 1,024 tokens) most
prompts share, and the distances where the RoPE phases nearly repeat (`rope_aliases`) to compare them with.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from hisparse.core.batch import ForwardTrace, Segment
from hisparse.engine.generate import prefill
from hisparse.kv.settings import KVSettings
from hisparse.model.rope import rope_frequencies
from hisparse.model.tokenizer import load_tokenizer
from hisparse.model.weights import load_model
from hisparse.train.evaluate import NEAR_KEYS, find
from hisparse.train.passkey import PASSKEY_DIGITS, sample_prompt


@torch.no_grad()
def trial(model, tok, settings: KVSettings, chars: int, depth: float, rng: random.Random, layer: int) -> dict:
    """One prompt: its answer, and per answer step the newest keys held and the far keys' distances."""
    text, value = sample_prompt(rng, chars, depth)
    ids = tok.encode(text, bos=True, eos=False)
    kv = settings.build(model.cfg)
    try:
        logits = prefill(model, kv, 0, ids, 1024)
        pos, out, near, far = len(ids), [], [], []
        for _ in range(PASSKEY_DIGITS + 2):     # the space, the digits, the full stop
            out.append(int(torch.argmax(logits)))
            trace = ForwardTrace()
            logits = model(torch.tensor([out[-1]]), [Segment(0, pos, 1)], kv, trace=trace)[0]
            chosen = trace.selections[layer][0][-1].tolist()
            near.append(sum(pos - p < NEAR_KEYS for p in chosen if p >= 0))
            far.append(sorted(pos - p for p in chosen if p >= 0 and pos - p >= NEAR_KEYS))
            pos += 1
    finally:
        kv.release(0)
    completion = tok.decode(out)
    return {"tokens": len(ids), "depth": depth, "needle_at": find(ids, tok.encode(value, bos=False, eos=False)),
            "value": value, "completion": completion, "found": completion.strip().rstrip(".").strip() == value,
            "newest_held_per_step": near, "far_distances_per_step": far}


FAR = 1024   # distances counted as far away: beyond the prompt's question and cue


def shared_distances(trials: list[dict], top: int = 12) -> list[dict]:
    """The distances of at least FAR picked in the most prompts (a key picked at steps i and i + 1 is one
    distance apart at the second, so each prompt's distances are counted once after subtracting the step)."""
    prompts: Counter = Counter()
    for t in trials:
        prompts.update({d - s for s, ds in enumerate(t["far_distances_per_step"]) for d in ds if d - s >= FAR})
    return [{"distance_at_first_step": d, "prompts": n} for d, n in prompts.most_common(top)]


def rope_aliases(model, context: int, top: int = 12) -> list[int]:
    """The distances in [FAR, context) where all RoPE pairs' phases come nearest to distance 0's (the smallest
    sum_j (1 - cos(distance omega_j)), omega the model's YaRN + LeRoPE frequencies), one per 64 tokens."""
    omega = rope_frequencies(model.cfg, model.lerope.alpha)
    d = torch.arange(FAR, context, dtype=torch.float64)
    gap = (1 - torch.cos(d[:, None] * omega[None, :])).sum(1)
    best = gap.view(-1)[: gap.numel() // 64 * 64].view(-1, 64).min(1)
    order = torch.argsort(best.values)[:top]
    return [int(d[i * 64 + best.indices[i]]) for i in order.tolist()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--chars", type=int, default=128000)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/needle/distances.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    tok = load_tokenizer(args.model).instruct_tokenizer.tokenizer
    settings = KVSettings(offload="hisparse", host_pool_gib=0.25, hot_buffer_tokens=128)
    rng = random.Random(f"distances:{args.seed}:{args.chars}")
    t0, trials = time.time(), []
    for i in tqdm(range(args.samples), desc=f"distances @ {args.chars:,} chars"):
        trials.append(trial(model, tok, settings, args.chars, i / max(1, args.samples - 1), rng, args.layer))
    result = {"model": args.model, "chars": args.chars, "layer": args.layer, "newest_keys": NEAR_KEYS,
              "lerope_alpha": [round(a, 4) for a in model.lerope.alpha.tolist()],
              "found": sum(t["found"] for t in trials), "samples": len(trials),
              "mean_newest_held_after_first_step": round(sum(
                  sum(t["newest_held_per_step"][1:]) / (len(t["newest_held_per_step"]) - 1) for t in trials)
                  / len(trials), 2),
              "far_distances_picked": sum(len(d) for t in trials for d in t["far_distances_per_step"]),
              "shared_far_distances": shared_distances(trials),
              "rope_aliases": rope_aliases(model, max(t["tokens"] for t in trials)), "trials": trials, "s": round(time.time() - t0, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "trials"}, indent=1))


if __name__ == "__main__":
    main()
