"""DSpark speculative decoding benchmark: tokens per target forward and decode tokens/s with vs without
speculation, for an oracle drafter (proposes the target's own greedy tokens: the upper bound), the oracle with the
real drafter run alongside (so drafting is paid for at full acceptance), and the checkpoint's drafter.

Every mode decodes the same prompt greedily; its tokens must equal plain decoding (lossless), else the run fails.
Prefill is not timed. One request, batch 1, single-threaded by default. Results -> JSON.

    python -m benchmarks.dspark.bench [--model DIR | --preset small] [--prompt 256] [--new 96]
                                      [--kv none,hisparse] [--out benchmarks/results/dspark.json]

`--serve` measures through `hisparse serve` instead (HiSparse KV, the server's defaults): one server plain and
one with `--speculative-config '{"method":"dspark","num_speculative_tokens":N}'`, the same greedy streamed
completions at each concurrency (haystack-continuation and passkey prompts of the needle task), which must be
identical text; acceptance (tokens per verify step, per-position acceptance) from each run's /metrics delta;
per-request decode tokens/s (tokens after the first over the time from first to last) and aggregate output tokens/s.

    python -m benchmarks.dspark.bench --serve --model checkpoints/needle-ml4 [--concurrency 1,4,8]
                                      [--out benchmarks/results/dspark_serve_needle.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import re
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.hisparse_server import start_serve
from hisparse.kv.settings import KVSettings
from hisparse.engine.speculative import OracleProposer, Proposer, SpeculativeConfig, SpeculativeDecoder
from hisparse.core.config import preset_params
from hisparse.model.dspark import DSparkDrafter
from hisparse.model.ml4 import ML4
from hisparse.model.tiny import random_model
from hisparse.model.weights import load_model
from hisparse.train.passkey import INTRO, SyntheticHaystack, sample_prompt

SPEC_METRIC = re.compile(r'^hisparse_spec_decode_(num_drafts|num_accepted_tokens|num_draft_tokens|'
                         r'num_accepted_tokens_per_pos)_total(?:\{position="(\d+)"\})? ([0-9.e+]+)$', re.M)


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


def serve_prompts(kind: str, count: int, seed: int) -> list[str]:
    """Completion prompts of the needle task: `haystack` (the passkey intro and ~700 characters of synthetic
    haystack cut mid-text, which the model continues) or `passkey` (a ~1,500-character haystack with the needle,
    ending in the answer cue)."""
    rng = random.Random(f"dspark-serve:{kind}:{seed}")
    if kind == "haystack":
        return [INTRO + "".join(SyntheticHaystack(rng.randrange(1 << 30)).units(40))[:700] for _ in range(count)]
    return [sample_prompt(rng, 1500, rng.random())[0] for _ in range(count)]


def start_server(model: str, spec: str | None, port: int, threads: int, log: Path) -> subprocess.Popen:
    return start_serve(["--model", model, "--host-pool-gib", "0.5"] + (["--speculative-config", spec] if spec else []),
                       port, threads, log)


def spec_counters(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {name + (f"[{pos}]" if pos else ""): float(v) for name, pos, v in SPEC_METRIC.findall(text)}


async def one(client: httpx.AsyncClient, port: int, prompt: str, max_tokens: int) -> dict:
    """A greedy streamed completion: its text, tokens and the times of its first and last token."""
    models = (await client.get(f"http://127.0.0.1:{port}/v1/models")).json()["data"]
    body = {"model": models[0]["id"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, t0, first, last, tokens = [], time.perf_counter(), None, None, 0
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices", []):
                if ch.get("text"):
                    now = time.perf_counter()
                    first, last = first or now, now
                    text.append(ch["text"])
    return {"text": "".join(text), "tokens": tokens, "ttft": first - t0, "decode_s": last - first}


async def run_load(port: int, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def guarded(p: str) -> dict:
            async with sem:
                return await one(client, port, p, max_tokens)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(guarded(p) for p in prompts))
    return res, time.perf_counter() - t0


def serve_bench(args: argparse.Namespace) -> dict:
    """Plain vs DSpark servers on the same loads; every completion must be identical."""
    spec = json.dumps({"method": "dspark", "num_speculative_tokens": args.num_spec})
    levels = [int(c) for c in args.concurrency.split(",")]
    loads = [("haystack", c, args.new) for c in levels] + [("passkey", 1, 12)]
    out: dict = {"setup": {"model": args.model, "server": "hisparse serve (HiSparse KV, defaults), OMP threads "
                           f"{args.threads}", "speculative_config": spec, "prompts_per_request_slot":
                           args.prompts_per_client, "haystack_max_tokens": args.new, "passkey_max_tokens": 12,
                           "temperature": 0, "cpu": platform.processor() or platform.machine(),
                           "torch": torch.__version__}, "runs": {}}
    texts: dict[str, dict[str, list[str]]] = {}
    for mode, sc in (("plain", None), ("dspark", spec)):
        log = Path(tempfile.gettempdir()) / f"dspark-serve-{mode}.log"
        proc = start_server(args.model, sc, args.port, args.threads, log)
        try:
            for kind, c, max_tokens in loads:
                prompts = serve_prompts(kind, max(2, args.prompts_per_client * c), args.seed)
                asyncio.run(run_load(args.port, prompts[:1], max_tokens, 1))   # warm-up
                before = spec_counters(args.port)
                res, wall = asyncio.run(run_load(args.port, prompts, max_tokens, c))
                after = spec_counters(args.port)
                d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                steps = d.get("num_drafts", 0)
                key = f"{kind}_c{c}"
                texts.setdefault(key, {})[mode] = [r["text"] for r in res]
                rates = [(r["tokens"] - 1) / r["decode_s"] for r in res if r["tokens"] > 1 and r["decode_s"] > 0]
                run = {"requests": len(res), "concurrency": c, "output_tokens": sum(r["tokens"] for r in res),
                       "wall_s": round(wall, 3), "output_tok_s": sum(r["tokens"] for r in res) / wall,
                       "decode_tok_s_per_request": sum(rates) / len(rates),
                       "mean_ttft_s": sum(r["ttft"] for r in res) / len(res)}
                if mode == "dspark":
                    run |= {"verify_steps": steps, "acceptance_length": 1 + d.get("num_accepted_tokens", 0) / steps,
                            "acceptance_per_position": [d.get(f"num_accepted_tokens_per_pos[{i}]", 0) / steps
                                                        for i in range(args.num_spec)]}
                out["runs"].setdefault(key, {})[mode] = run
                print(key, mode, json.dumps(run), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    for key, modes in texts.items():
        if modes["plain"] != modes["dspark"]:
            raise SystemExit(f"{key}: DSpark completions differ from plain greedy decoding")
        r = out["runs"][key]
        r["identical_greedy_output"] = True
        r["speedup_decode_per_request"] = (r["dspark"]["decode_tok_s_per_request"]
                                           / r["plain"]["decode_tok_s_per_request"])
        r["speedup_output_tok_s"] = r["dspark"]["output_tok_s"] / r["plain"]["output_tok_s"]
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
    ap.add_argument("--serve", action="store_true", help="measure through `hisparse serve` (needs --model)")
    ap.add_argument("--concurrency", default="1,4,8", help="--serve: concurrent requests per run")
    ap.add_argument("--prompts-per-client", type=int, default=4, help="--serve: requests = this x concurrency")
    ap.add_argument("--num-spec", type=int, default=3, help="--serve: num_speculative_tokens")
    ap.add_argument("--port", type=int, default=8437)
    args = ap.parse_args()
    if args.serve:
        if not args.model:
            raise SystemExit("--serve: --model is required (a checkpoint with a drafter and a tokenizer)")
        res = serve_bench(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res, indent=2))
        return
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
