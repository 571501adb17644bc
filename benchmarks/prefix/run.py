"""Prefix caching: five questions over one long document, one after another, through a real server.

For each document length the same five prompts (the document's token ids, then one of five questions) go, in
order, to a server with prefix caching (the default) and to one started with --no-enable-prefix-caching. Per
question: the time to first token (streamed completion), the greedy answer, and whether it equals the cache-off
server's. The figure: mean TTFT of questions 2-5 over question 1's on the caching server (question 1 prefills the
whole document; the others only what follows its cached pages). `--server vllm` runs the same against `vllm
serve` with the HiSparseConnector (vLLM's own prefix caching off, as the plugin sets it). Writes JSON and a PNG.

    python -m benchmarks.prefix.run --model checkpoints/needle-ml4 [--lengths 32k,128k] [--server hisparse|vllm]
        [--out benchmarks/results/prefix]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from tqdm import tqdm

from benchmarks.hisparse_server import start_serve
from benchmarks.needle.harness import parse_lengths
from hisparse.model.tokenizer import load_tokenizer
from hisparse.train.passkey import COMPLETION_CUE, QUESTION, sample_prompt

QUESTIONS = (QUESTION, "Which number is hidden in the text above? Answer with the number only.",
             "Read the text again and give the secret passkey.", "Write down the passkey, digits only.",
             "The text hides one number. What is it?")
MAX_TOKENS = 10
CHARS_PER_TOKEN = 3.0      # the synthetic haystack's text per token, with a margin (the document is cut to length)


def prompts(model_dir: Path, n_tokens: int, seed: int) -> list[list[int]]:
    """Five prompts of token ids: one n_tokens-token document (a passkey haystack, needle at half depth) followed
    by each question."""
    text = sample_prompt(random.Random(seed), int(n_tokens * CHARS_PER_TOKEN), 0.5)[0]
    doc_text = text[:text.index(QUESTION)]
    tok = load_tokenizer(model_dir).instruct_tokenizer.tokenizer
    doc = tok.encode(doc_text, bos=True, eos=False)[:n_tokens]
    return [doc + tok.encode(q + COMPLETION_CUE, bos=False, eos=False) for q in QUESTIONS]


def ask(url: str, model: str, prompt: list[int]) -> tuple[float, str]:
    """(seconds to the first streamed token, the completion) of one greedy request. A plain HTTP client: the
    openai client's request validation walks a long token-id prompt for longer than a cached prefill takes."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True})
    t0 = time.monotonic()
    ttft, text = None, ""
    with httpx.stream("POST", f"{url}/completions", content=body, headers={"Content-Type": "application/json"},
                      timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None:
                ttft = time.monotonic() - t0
            text += chunk["choices"][0]["text"] if chunk.get("choices") else ""
    return ttft, text


@contextmanager
def server(kind: str, model_dir: Path, caching: bool, max_len: int, port: int, threads: int,
           log: Path) -> Iterator[str]:
    """A running server (hisparse or vllm), prefix caching on or off; yields its base URL."""
    if kind == "hisparse":
        flags = ["--model", str(model_dir), "--max-model-len", str(max_len), "--host-pool-gib", "4",
                 "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
        proc = start_serve(flags, port, threads, log)
    else:
        from benchmarks.prefix.vllm_server import start_vllm
        proc = start_vllm(model_dir, caching, max_len, port, threads, log)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def run(args: argparse.Namespace) -> dict:
    model_dir = Path(args.model)
    lengths = [(label, n) for label, n in parse_lengths(args.lengths)]
    docs = {label: prompts(model_dir, n, args.seed) for label, n in lengths}
    max_len = max(len(p) for ps in docs.values() for p in ps) + MAX_TOKENS + 8
    results = {label: {"document_tokens": n, "prompt_tokens": [len(p) for p in docs[label]]} for label, n in lengths}
    logs = Path(tempfile.mkdtemp())
    bar = tqdm(total=2 * sum(len(ps) for ps in docs.values()), desc="requests", unit="req")
    for caching in (True, False):
        key = "cache_on" if caching else "cache_off"
        with server(args.server, model_dir, caching, max_len, args.port, args.threads, logs / f"{key}.log") as url:
            name = httpx.get(f"{url}/models").json()["data"][0]["id"]
            for label, ps in docs.items():
                rows = []
                for p in ps:
                    ttft, text = ask(url, name, p)
                    rows.append({"ttft_s": ttft, "answer": text})
                    bar.update()
                results[label][key] = rows
    bar.close()
    for label, r in results.items():
        on, off = r["cache_on"], r["cache_off"]
        later = [q["ttft_s"] for q in on[1:]]
        r["ttft_ratio"] = sum(later) / len(later) / on[0]["ttft_s"]
        r["identical"] = [a["answer"] == b["answer"] for a, b in zip(on, off)]
        print(f"{label}: TTFT q1 {on[0]['ttft_s']:.2f} s, q2-5 mean {sum(later) / len(later):.3f} s "
              f"(ratio {r['ttft_ratio']:.4f}); answers identical to cache off: {sum(r['identical'])}/{len(on)}",
              flush=True)
    return {"benchmark": "prefix caching: five questions over one document, sequential",
            "server": args.server, "model": model_dir.name, "max_tokens": MAX_TOKENS, "questions": list(QUESTIONS),
            "server_threads": args.threads, "machine": platform.processor() or platform.machine(),
            "command": " ".join(["python -m benchmarks.prefix.run", *sys.argv[1:]]), "lengths": results}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = list(result["lengths"])
    fig, axes = plt.subplots(1, len(labels), figsize=(5 * len(labels), 4), squeeze=False)
    for ax, label in zip(axes[0], labels):
        r = result["lengths"][label]
        xs = range(1, len(r["cache_on"]) + 1)
        ax.bar([x - 0.2 for x in xs], [q["ttft_s"] for q in r["cache_off"]], 0.4, label="prefix caching off")
        ax.bar([x + 0.2 for x in xs], [q["ttft_s"] for q in r["cache_on"]], 0.4, label="prefix caching on")
        ax.set_yscale("log")
        ax.set_xlabel("question (same document)")
        ax.set_ylabel("time to first token (s)")
        ax.set_title(f"{label} ({r['document_tokens']:,}-token document): q2-5 / q1 = {r['ttft_ratio']:.4f}")
        ax.legend(loc="center right")
    fig.suptitle(f"{result['model']} through {result['server']} serve, {result['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint dir (with its tokenizer), e.g. checkpoints/needle-ml4")
    ap.add_argument("--lengths", default="32k,128k", help="document lengths in tokens (k = 1024)")
    ap.add_argument("--server", choices=("hisparse", "vllm"), default="hisparse")
    ap.add_argument("--threads", type=int, default=2, help="OMP threads of the server")
    ap.add_argument("--port", type=int, default=8437)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/prefix")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    name = "prefix" if args.server == "hisparse" else "prefix_vllm"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"{name}.png")
    print(f"wrote {out / name}.json and .png")


if __name__ == "__main__":
    main()
