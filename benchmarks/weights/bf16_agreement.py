"""Greedy agreement of `hisparse serve --dtype bfloat16` with `--dtype float32` on the same checkpoint.

    python -m benchmarks.weights.bf16_agreement [--model DIR] [--prompts 32] [--max-tokens 32] [--seed 0]

Without --model it writes the FP8 tiny checkpoint (`hisparse make-tiny --fp8`, seed 0) to --workdir. Both servers
run one after the other on the CPU; every prompt (random token ids) is completed greedily by each, with
`ignore_eos`. Reported: `free_running` (the fraction of generated positions where both servers emit the same
token; after a first difference the two continuations see different contexts, so this mostly measures where
they first part), `common_prefix` (the mean fraction before that first difference), and `teacher_forced` (the
bf16 model's next-token argmax on the fp32 server's own continuation, computed in this process: the per-token
agreement of the two precisions on the same context).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results" / "weights" / "bf16_agreement.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def serve_greedy(model: Path, dtype: str, prompts: list[list[int]], max_tokens: int, log: Path) -> list[list[int]]:
    """Start `hisparse serve --dtype dtype`, complete every prompt greedily, stop it: generated token ids."""
    port = _free_port()
    cmd = [sys.executable, "-m", "hisparse.cli", "serve", "--model", str(model), "--port", str(port),
           "--device", "cpu", "--dtype", dtype, "--host-pool-gib", "0.25", "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{log.read_text()}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start:\n{log.read_text()}") from None
                time.sleep(0.3)
        out = []
        for p in prompts:
            r = _post(f"{url}/v1/completions", {"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                                "ignore_eos": True, "return_token_ids": True})
            out.append(r["choices"][0]["token_ids"])
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@torch.no_grad()
def teacher_forced(model_dir: Path, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """Fraction of positions where the bf16 model's argmax, given the prompt and the continuation so far,
    is the continuation's next token."""
    from hisparse.core.batch import Segment
    from hisparse.kv.resident import ResidentKV
    from hisparse.model.weights import load_model
    model = load_model(model_dir, dtype=torch.bfloat16, progress=False)
    same = total = 0
    for p, c in zip(prompts, continuations):
        seq = torch.tensor(p + c)
        z = model(seq, [Segment(0, 0, len(seq))], ResidentKV(model.cfg, None, dtype=model.dtype))
        pred = z[len(p) - 1:-1].argmax(-1).tolist()
        same += sum(a == b for a, b in zip(pred, c))
        total += len(c)
    return same / total


def measure(model: Path, n_prompts: int, max_tokens: int, seed: int, workdir: Path) -> dict:
    from hisparse.core.config import ModelConfig
    vocab = ModelConfig.load(model).vocab_size
    g = torch.Generator().manual_seed(seed)
    lo = min(1000, vocab // 2)   # past the control tokens
    prompts = [torch.randint(lo, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 40, (n_prompts,), generator=g)]
    ref = serve_greedy(model, "float32", prompts, max_tokens, workdir / "serve-float32.log")
    got = serve_greedy(model, "bfloat16", prompts, max_tokens, workdir / "serve-bfloat16.log")
    total = sum(len(a) for a in ref)
    same = sum(x == y for a, b in zip(ref, got) for x, y in zip(a, b))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ref, got))
    return {"model": str(model), "prompts": n_prompts, "max_tokens": max_tokens, "seed": seed,
            "tokens": total, "free_running": same / total, "common_prefix": prefix / total,
            "teacher_forced": teacher_forced(model, prompts, ref)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the FP8 tiny checkpoint, written)")
    ap.add_argument("--workdir", default="/tmp/hisparse-bf16-agreement", help="logs, tiny checkpoint "
                                                                             "(default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=32, help="prompts (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (default: %(default)s)")
    ap.add_argument("--out", default=str(RESULTS), help="result JSON (default: %(default)s)")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else workdir / "tiny-fp8"
    if not args.model and not (model / "consolidated.safetensors").exists():
        from hisparse.model.tiny import make_tiny
        make_tiny(model, fp8=True, seed=0)
    r = measure(model, args.prompts, args.max_tokens, args.seed, workdir)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
    print(f"{r['model']}: {r['tokens']} greedy tokens, bf16 vs fp32: free-running {r['free_running']:.3f}, "
          f"common prefix {r['common_prefix']:.3f}, teacher-forced {r['teacher_forced']:.3f}")


if __name__ == "__main__":
    main()
