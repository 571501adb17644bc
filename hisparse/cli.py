"""`hisparse` command line: make-tiny, generate, logits, serve, train-needle, train-drafter."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

from .engine.cuda_graphs import GRAPH_MODES
from .kv.settings import KVSettings, KVSettingsError
from .engine.request import MAX_LOGPROBS
from .host_pool.layout import LAYOUTS
from .train.recipe import LONG_STAGES, Recipe

API_KEY_ENV = "HISPARSE_API_KEY"   # `hisparse serve`'s API key when --api-key is not given (as vLLM's VLLM_API_KEY)


def _ids(text: str, vocab_size: int) -> list[int]:
    """--prompt-ids: comma-separated token ids, at least one, each in [0, vocab_size)."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise SystemExit("--prompt-ids: empty")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise SystemExit(f"--prompt-ids: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return ids


TRAINED_CHECKPOINT = "checkpoints/needle-ml4"   # in the repository: the tiny ML4 trained to retrieve passkeys


def model_dir(arg: str | None, tokenizer: bool, builtin_note: bool) -> Path:
    """--model's checkpoint folder, checked here once for every command: a missing folder, params.json, weights or
    (with `tokenizer`) tekken.json ends the command with one line on stderr naming --model and what is missing,
    exit status 2. Without --model: the built-in tiny checkpoint, announced on stderr as random if
    `builtin_note`."""
    if not arg:
        from .model.tiny import builtin_tiny
        if builtin_note:
            print(f"hisparse: no --model: the built-in tiny checkpoint has random weights (its output is "
                  f"meaningless text); for a trained model that retrieves passkeys use --model {TRAINED_CHECKPOINT}",
                  file=sys.stderr, flush=True)
        return builtin_tiny()
    path = Path(arg)
    if not path.exists():
        missing = "no such folder"
    elif not path.is_dir():
        missing = "not a folder"
    elif not (path / "params.json").is_file():
        missing = "no params.json (not a Mistral-native checkpoint folder)"
    elif not any(path.glob("consolidated*.safetensors")):
        missing = "no consolidated*.safetensors (the weights of a Mistral-native checkpoint)"
    elif tokenizer and not (path / "tekken.json").is_file():
        missing = "no tekken.json (the tokenizer that text prompts need)"
    else:
        return path
    print(f"hisparse: --model {arg}: {missing}", file=sys.stderr)
    raise SystemExit(2)


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Where the model and its latent KV compute, and in what precision; shared by generate and serve."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="compute device of the model and the device rows (default: %(default)s)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="compute dtype of the activations and the device rows; weights stay in checkpoint "
                        "precision (FP8 linears stay FP8 in every dtype, bf16 tensors stay bf16 under bfloat16; "
                        "float32/float64 are exactness references) (default: bfloat16 on a CUDA --device, "
                        "float32 elsewhere)")


def compute_dtype(args: argparse.Namespace) -> torch.dtype:
    """--dtype, or its default for --device: bf16 on CUDA, fp32 elsewhere (CPUs lack fast bf16 GEMMs)."""
    if args.dtype is None:
        return torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
    return DTYPES[args.dtype]


def kv_settings(args: argparse.Namespace) -> KVSettings:
    """The KV flags' settings; a bad value ends the command with a message naming its flag."""
    try:
        return KVSettings.from_args(args)
    except KVSettingsError as e:
        raise SystemExit(str(e)) from None


def cmd_make_tiny(args: argparse.Namespace) -> None:
    from .model.tiny import make_tiny
    out = make_tiny(args.out, preset=args.preset, fp8=args.fp8, seed=args.seed)
    print(f"wrote {args.preset} checkpoint to {out}")


def cmd_generate(args: argparse.Namespace) -> None:
    from .engine.generate import greedy_generate
    from .model.weights import load_model
    settings = kv_settings(args)
    ckpt = model_dir(args.model, tokenizer=args.prompt is not None, builtin_note=True)
    model = load_model(ckpt, device=args.device, dtype=compute_dtype(args))
    tok = None
    if args.prompt_ids is not None:
        prompt = _ids(args.prompt_ids, model.cfg.vocab_size)
    else:
        from .model.tokenizer import load_tokenizer
        tok = load_tokenizer(ckpt).instruct_tokenizer.tokenizer
        prompt = tok.encode(args.prompt, bos=True, eos=False)
    if not prompt:
        raise SystemExit("prompt: empty")
    kv = settings.attach(model)
    gen = greedy_generate(model, kv, prompt, args.max_tokens, chunk=args.chunk)
    if tok is None and (ckpt / "tekken.json").exists():
        from .model.tokenizer import load_tokenizer
        tok = load_tokenizer(ckpt).instruct_tokenizer.tokenizer
    if tok is not None:
        print(tok.decode(gen.tokens))
    print("ids:", ",".join(map(str, gen.tokens)))
    stats = getattr(kv, "stats", None)
    if stats is not None:
        print("hisparse:", stats.summary(), file=sys.stderr)


def cmd_logits(args: argparse.Namespace) -> None:
    from .core.batch import Segment
    from .kv.resident import ResidentKV
    from .model.weights import load_model
    dtype = compute_dtype(args)
    model = load_model(model_dir(args.model, tokenizer=False, builtin_note=False), device=args.device, dtype=dtype)
    ids = _ids(args.prompt_ids, model.cfg.vocab_size)
    kv = ResidentKV(model.cfg, layout=args.kv_layout, device=args.device, dtype=dtype, index_cache=args.index_cache)
    logits = model(torch.tensor(ids, device=args.device), [Segment(0, 0, len(ids))], kv)
    np.save(args.out, logits.cpu().numpy() if dtype == torch.float64 else logits.float().cpu().numpy())
    print(f"wrote logits {tuple(logits.shape)} to {args.out}")


def cmd_serve(args: argparse.Namespace) -> None:
    settings = kv_settings(args)
    ckpt = model_dir(args.model, tokenizer=True, builtin_note=True)
    from .server.serve import serve     # imported after the check: a bad --model fails at once
    from .server.serve_config import ServeConfig
    serve(ServeConfig.from_args(args, ckpt, compute_dtype(args), settings))


def cmd_train_needle(args: argparse.Namespace) -> None:
    from .train.trainer import main
    main(args)


def cmd_train_drafter(args: argparse.Namespace) -> None:
    from .train.drafter import main
    main(args)


def build_parser() -> argparse.ArgumentParser:
    from .parallel.group import DEFAULT_TIMEOUT_S
    ap = argparse.ArgumentParser(prog="hisparse", description="Long-context ML4 serving with host-memory sparse KV")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_make_tiny(sub)
    add_generate(sub)
    add_logits(sub)
    add_serve(sub, DEFAULT_TIMEOUT_S)
    add_train_needle(sub)
    add_train_drafter(sub)
    return ap


def add_make_tiny(sub: argparse._SubParsersAction) -> None:
    """`make-tiny`: its output folder, size, weight format and seed."""
    p = sub.add_parser("make-tiny", help="write a tiny random Mistral-native ML4 checkpoint")
    p.add_argument("out", help="checkpoint dir to write")
    p.add_argument("--preset", choices=("tiny", "small"), default="tiny", help="model size (default: %(default)s)")
    p.add_argument("--fp8", action="store_true", help="store linear weights as block-scaled fp8 e4m3")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)")
    p.set_defaults(fn=cmd_make_tiny)


def add_generate(sub: argparse._SubParsersAction) -> None:
    """`generate`: the prompt (text or ids), how much to generate, and the KV and runtime flags."""
    p = sub.add_parser("generate", help="greedy generation for one prompt")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny checkpoint)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text, encoded with the checkpoint's tekken.json (this or --prompt-ids "
                                    "is required)")
    g.add_argument("--prompt-ids", help="prompt as comma-separated token ids (this or --prompt is required)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk size (default: %(default)s)")
    KVSettings.add_args(p)
    add_runtime_args(p)
    p.set_defaults(fn=cmd_generate)


def add_logits(sub: argparse._SubParsersAction) -> None:
    """`logits`: the prompt ids, the output file and the KV row format."""
    p = sub.add_parser("logits", help="full-forward logits [T, V] of a prompt to a .npy file (fp32; fp64 under "
                                      "--dtype float64)")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny checkpoint)")
    p.add_argument("--prompt-ids", required=True, help="prompt as comma-separated token ids")
    p.add_argument("--out", required=True, help=".npy file to write")
    p.add_argument("--kv-layout", default=None, choices=LAYOUTS,
                   help="store the KV in this row format, as `serve` does (default: unquantised)")
    KVSettings.add_args(p, ["index_cache"])
    add_runtime_args(p)
    p.set_defaults(fn=cmd_logits)


def add_serve(sub: argparse._SubParsersAction, dcp_timeout: float) -> None:
    """`serve` (`dcp_timeout`: --dcp-timeout's default): where it listens and what it schedules, then its
    limits on requests, then parallelism, then the KV and runtime flags."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny checkpoint)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: the dir name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + max_tokens limit per request (default: what the model and KV cache allow)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests decoding at once (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens per forward step (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}, which keeps "
                        "the key out of the process list)")
    add_serve_limits(p)
    add_parallel_args(p, dcp_timeout)
    KVSettings.add_args(p)
    add_runtime_args(p)
    p.set_defaults(fn=cmd_serve)


def add_serve_limits(p: argparse.ArgumentParser) -> None:
    """`serve`'s limits on requests, timeouts and scheduling fairness, and its optional features."""
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body accepted, else 413 (default: 1 MiB + 16 B per --max-model-len token)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers (else the connection is closed) and its "
                        "body (else 408) (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds in-flight requests get to finish before they end with an "
                        "error and the server exits (default: %(default)s)")
    p.add_argument("--fair-prefill-tokens", type=int, default=128,
                   help="while requests of several API requests run, prefill tokens per step, shared round-robin "
                        "between them (a prompt-logprob token counts 33); 0: the whole step budget, oldest "
                        "request first (default: %(default)s)")
    p.add_argument("--max-batch-fanout", type=int, default=256,
                   help="most engine requests one API request may create (prompts x n), else 400 "
                        "(default: %(default)s)")
    p.add_argument("--max-logit-bias", type=int, default=1024,
                   help="most logit_bias entries per request, else 400 (default: %(default)s)")
    p.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                   help="most alternatives per token for logprobs, top_logprobs and prompt_logprobs (at most the "
                        "vocabulary), else 400 (default: %(default)s)")
    p.add_argument("--max-header-bytes", type=int, default=16384,
                   help="largest request head (request line and headers), else 431 (default: %(default)s)")
    p.add_argument("--enable-docs", action="store_true",
                   help="serve the API's /docs, /redoc and /openapi.json (default: off)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, the JSON vllm serve takes: {"method": "dspark", '
                        '"num_speculative_tokens": 3, "draft_sample_method": "greedy"|"probabilistic"} '
                        "(needs a checkpoint with a DSpark drafter) (default: off)")
    p.add_argument("--debug-hooks", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="uvicorn's log level (default: %(default)s)")


def add_parallel_args(p: argparse.ArgumentParser, dcp_timeout: float) -> None:
    """`serve`'s tensor and decode-context parallelism, and its decode CUDA graphs."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="tensor parallelism: rank processes, each with 1/T of the heads, FFNs, vocabulary and routed "
                        "experts; this process is rank 0 and starts the others (or run under torchrun "
                        "--nproc-per-node T) (default: %(default)s)")
    p.add_argument("--decode-context-parallel-size", "-dcp", "--dcp-size", dest="decode_context_parallel_size",
                   type=int, default=1,
                   help="decode context parallelism: ranks sharing every request's KV (each holds 1/D of the rows and "
                        "indexer keys); with -tp T, D divides T and each DCP group is D consecutive TP ranks; "
                        "without -tp, D rank processes (default: %(default)s)")
    p.add_argument("--dcp-interleave", type=int, default=1,
                   help="DCP: consecutive tokens per rank (I) (default: %(default)s)")
    p.add_argument("--dcp-timeout", type=float, default=dcp_timeout,
                   help="DCP: seconds a collective may wait for a peer rank before the server fails "
                        "(default: %(default)s)")
    p.add_argument("--cuda-graph", choices=GRAPH_MODES, default="full",
                   help="decode steps as CUDA graphs: full: the whole step (every layer and KV call) per step "
                        "shape, on CUDA with the Triton kernels (parallel ranks: piecewise); piecewise: the dense "
                        "parts between eager KV calls; off: eager, for debugging (default: %(default)s)")


def add_train_needle(sub: argparse._SubParsersAction) -> None:
    """`train-needle`: where to write, resuming, and the evaluation's lengths, samples and hot buffer."""
    p = sub.add_parser("train-needle", help="train the tiny passkey-retrieval ML4 on the CPU and evaluate it")
    p.add_argument("--out", default=TRAINED_CHECKPOINT, help="checkpoint dir to write (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="training seed (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue after the last stage checkpoint in --out")
    p.add_argument("--rope-theta", type=float, default=Recipe.rope_theta,
                   help="the model's rope_theta (default: %(default)s)")
    p.add_argument("--yarn-factor", type=int, default=Recipe.yarn_factor,
                   help="the model's YaRN factor over an original length of 64 (default: %(default)s)")
    p.add_argument("--long-stages", choices=sorted(LONG_STAGES), default="sparse-128k",
                   help="the stages after the shipped model's (docs/needle-model.md) (default: %(default)s)")
    p.add_argument("--eval-only", action="store_true", help="skip training; evaluate the checkpoint in --out")
    p.add_argument("--eval-chars", default="1000,4000,8000",
                   help="haystack lengths (characters = tokens) (default: %(default)s)")
    p.add_argument("--eval-samples", type=int, default=20,
                   help="fresh passkey prompts per length (default: %(default)s)")
    p.add_argument("--hot-buffer-tokens", type=int, default=128,
                   help="HiSparse hot slots used by the evaluation (default: %(default)s)")
    p.set_defaults(fn=cmd_train_needle)


def add_train_drafter(sub: argparse._SubParsersAction) -> None:
    """`train-drafter`: the checkpoint to train in place (or copy to --out), seed, resuming and steps."""
    p = sub.add_parser("train-drafter", help="train a checkpoint's DSpark drafter by distillation from the target")
    p.add_argument("--model", default=TRAINED_CHECKPOINT, help="checkpoint dir (default: %(default)s)")
    p.add_argument("--out", default=None, help="checkpoint dir to write (default: --model, in place)")
    p.add_argument("--seed", type=int, default=0, help="training seed (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue from the last saved state in --out")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    p.set_defaults(fn=cmd_train_drafter)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
