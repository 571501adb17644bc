"""DSpark speculative decoding benchmark: tokens per target forward and decode tokens/s with vs without
speculation, for an oracle drafter (proposes the target's own greedy tokens: the upper bound), the oracle with the
real drafter run alongside (so drafting is paid for at full acceptance), and the checkpoint's drafter.

Every mode decodes the same prompt greedily; its tokens must equal plain decoding (lossless), else the run fails.
Prefill is not timed. One request, batch 1, single-threaded by default. Results -> JSON.

    python -m benchmarks.dspark.bench [--model DIR | --preset small] [--prompt 256] [--new 96]
                                      [--kv none,hisparse] [--out benchmarks/results/dspark.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from hisparse.engine.kv_settings import KVSettings
from hisparse.engine.speculative import OracleProposer, Proposer, SpeculativeConfig, SpeculativeDecoder
from hisparse.model.config import preset_params
from hisparse.model.dspark import DSparkDrafter
from hisparse.model.ml4 import ML4
from hisparse.model.tiny import random_model
from hisparse.model.weights import load_model


def decode(model: ML4, kv_kind: str, proposer: Proposer, n_spec: int, prompt: list[int], new: int) -> dict:
    """Prefill, then time the decode of `new` tokens (n_spec 0: one plain forward per token)."""
    kv = KVSettings(kv_kind, host_pool_gib=0.25).build(model.cfg, model.device, model.dtype)
    dec = SpeculativeDecoder(model, kv, proposer, SpeculativeConfig(num_speculative_tokens=max(n_spec, 1)))
    st = dec.start(0, prompt)
    out = [st.anchor]
    t0, c0 = time.perf_counter(), time.process_time()
    while len(out) < new:
        out += dec.step(st, new - len(out) if n_spec else 1)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    dec.release(0)
    n_dec = len(out) - 1
    return {"tokens": out, "decode_seconds": seconds, "decode_cpu_seconds": cpu_seconds, "decode_tokens": n_dec,
            "target_forwards": dec.stats.steps, "tokens_per_target_forward": n_dec / dec.stats.steps,
            "decode_tok_s": n_dec / seconds, "decode_tok_per_cpu_s": n_dec / cpu_seconds,
            "drafts_proposed": dec.stats.proposed, "drafts_accepted": dec.stats.accepted,
            "acceptance_length": dec.stats.acceptance_length, "accepted_histogram": dec.stats.histogram}


def bench_kv(model: ML4, kv_kind: str, prompt: list[int], new: int, repeat: int) -> dict:
    """Every mode `repeat` times, interleaved (so load drift hits all modes alike); the fastest run of each."""
    plain = decode(model, kv_kind, OracleProposer([]), 0, prompt, new)
    seq = prompt + plain["tokens"]
    modes = {"plain": lambda: (OracleProposer([]), 0), "checkpoint_drafter_n3": lambda: (DSparkDrafter(model), 3),
             "oracle_with_drafting_n3": lambda: (OracleProposer(seq, DSparkDrafter(model)), 3)}
    modes |= {f"oracle_n{n}": (lambda n=n: (OracleProposer(seq), n)) for n in (1, 2, 3)}
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(repeat):
        for name, make in modes.items():
            runs[name].append(decode(model, kv_kind, *make(), prompt, new))
    best = {name: {"wall": min(rs, key=lambda r: r["decode_seconds"]),
                   "cpu": min(rs, key=lambda r: r["decode_cpu_seconds"])} for name, rs in runs.items()}
    out = {}
    for name, make in modes.items():
        if any(r["tokens"] != plain["tokens"] for r in runs[name]):
            raise SystemExit(f"{kv_kind}/{name}: speculative tokens differ from plain greedy decoding")
        n = make()[1]
        r = {k: v for k, v in best[name]["wall"].items() if k not in ("tokens", "decode_cpu_seconds",
                                                                        "decode_tok_per_cpu_s")}
        r["decode_cpu_seconds"] = best[name]["cpu"]["decode_cpu_seconds"]
        r["decode_tok_per_cpu_s"] = best[name]["cpu"]["decode_tok_per_cpu_s"]
        r["speedup_vs_plain_wall"] = r["decode_tok_s"] / best["plain"]["wall"]["decode_tok_s"]
        r["speedup_vs_plain_cpu"] = r["decode_tok_per_cpu_s"] / best["plain"]["cpu"]["decode_tok_per_cpu_s"]
        if n:
            r["ideal_speedup"] = r["tokens_per_target_forward"]
            r["step_cost_vs_plain_forward_cpu"] = r["tokens_per_target_forward"] / r["speedup_vs_plain_cpu"]
            r["overhead_vs_ideal_cpu"] = 1 - r["speedup_vs_plain_cpu"] / r["tokens_per_target_forward"]
        out[name] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory with a drafter (default: random --preset model)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=97, help="tokens to generate (the first one comes from prefill)")
    ap.add_argument("--kv", default="none,hisparse")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/dspark.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model:
        model = load_model(args.model, device=args.device)
    else:
        params = preset_params(args.preset)
        params["max_position_embeddings"] = max(params["max_position_embeddings"], 2 * (args.prompt + args.new))
        model = random_model(params, args.seed).to(args.device)
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt,), generator=g).tolist()
    res = {"setup": {"model": args.model or f"random {args.preset} preset, seed {args.seed}",
                     "prompt_tokens": args.prompt, "generated_tokens": args.new, "batch": 1,
                     "device": args.device, "threads": args.threads, "torch": torch.__version__,
                     "cpu": platform.processor() or platform.machine(), "repeat": args.repeat,
                     "timing": "decode only (prefill excluded); best of interleaved repeats, by wall clock "
                               "and by process CPU time (robust on a shared machine)"}}
    for kv_kind in args.kv.split(","):
        modes = res[kv_kind] = bench_kv(model, kv_kind, prompt, args.new, args.repeat)
        drafting = modes["oracle_with_drafting_n3"]["speedup_vs_plain_cpu"]
        res.setdefault("summary", {})[kv_kind] = {
            "oracle_n3_speedup_cpu": modes["oracle_n3"]["speedup_vs_plain_cpu"],
            "oracle_with_drafting_n3_speedup_cpu": drafting,
            "drafting_plus_verify_overhead_vs_ideal_4x": 1 - drafting / 4,
            "goal_overhead_at_most_10pct": drafting >= 3.6,
            "checkpoint_drafter_acceptance_length": modes["checkpoint_drafter_n3"]["acceptance_length"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
