"""`hisparse serve`: load a checkpoint, build the KV store and the engine, print the capacity, run uvicorn."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..engine.engine import Engine
from ..engine.scheduler import SchedulerConfig
from ..engine.speculative import SpeculativeConfig
from ..model.config import ModelConfig
from ..model.dspark import DraftWindowCache
from ..model.kv import LatentKV
from ..model.ml4 import ML4
from ..model.tokenizer import load_tokenizer
from ..model.weights import load_model
from .app import ServerConfig, build_app


def capacity_lines(kv: LatentKV, offload: str, max_model_len: int) -> list[str]:
    """What fits, in the words of vLLM's startup log."""
    cap = kv.token_capacity()
    where = "host pool" if offload == "hisparse" else "device"
    lines = [f"KV cache ({where}): unbounded; maximum model length {max_model_len:,} tokens"] if cap is None else [
        f"KV cache ({where}) size: {cap:,} tokens",
        f"Maximum concurrency for {max_model_len:,} tokens per request: {cap / max_model_len:.2f}x"]
    if offload == "hisparse":
        rows = kv.n_slots + kv.window + kv.sinks
        lines.append(f"Device latent rows per request and layer: {rows:,} (hot buffer {kv.n_slots:,} + resident "
                     f"window {kv.window:,} + sinks {kv.sinks:,}), whatever the context length")
    return lines


def speculative_config(spec: str | None, model_dir: Path) -> SpeculativeConfig | None:
    """--speculative-config, checked against the checkpoint's params.json before any weight is loaded."""
    if spec is None:
        return None
    cfg = ModelConfig.load(model_dir)
    try:
        return SpeculativeConfig.parse(spec, cfg)
    except ValueError as e:
        raise SystemExit(f"--speculative-config: {e}") from None


def speculative_lines(spec: SpeculativeConfig, model: ML4) -> list[str]:
    window = DraftWindowCache.for_config(model.cfg)
    return [f"Speculative decoding: {spec.method}, {spec.num_speculative_tokens} draft tokens per step "
            f"(draft_sample_method {spec.draft_sample_method}); draft window cache {window.window:,} tokens, "
            f"{window.bytes_per_request:,} bytes per request"]


def build_engine(model: ML4, kv: LatentKV, tokenizer, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, speculative: SpeculativeConfig | None = None) -> Engine:
    inner = tokenizer.instruct_tokenizer.tokenizer
    per_seq = 1 + (speculative.num_speculative_tokens if speculative else 0)   # every decode fits, drafts included
    cfg = SchedulerConfig(max_model_len, max_num_seqs, max(max_num_batched_tokens, max_num_seqs * per_seq))
    return Engine(model, kv, cfg, eos_id=inner.eos_id, decode=inner.decode, speculative=speculative)


def serve(args: argparse.Namespace, model_dir: Path, kv_factory) -> None:
    """Run the server until interrupted. `kv_factory(cfg)` builds the LatentKV from the CLI's KV flags."""
    import uvicorn
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    speculative = speculative_config(args.speculative_config, model_dir)
    model = load_model(model_dir, device=args.device)
    tokenizer = load_tokenizer(model_dir)
    kv = kv_factory(model.cfg)
    cap = kv.token_capacity()
    limit = model.cfg.max_position_embeddings if cap is None else min(model.cfg.max_position_embeddings, cap)
    max_model_len = args.max_model_len or limit
    if max_model_len > model.cfg.max_position_embeddings:
        raise SystemExit(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
                         f"{model.cfg.max_position_embeddings}")
    if not kv.can_ever_admit(max_model_len):
        raise SystemExit(f"--max-model-len {max_model_len} does not fit in the KV cache ({cap:,} tokens); "
                         "raise --host-pool-gib or lower --max-model-len")
    engine = build_engine(model, kv, tokenizer, max_model_len, args.max_num_seqs, args.max_num_batched_tokens,
                          speculative)
    name = args.served_model_name or model_dir.name
    app = build_app(engine, tokenizer, ServerConfig(name, max_model_len, args.api_key, args.debug_hooks))
    for line in capacity_lines(kv, args.kv_offload, max_model_len) + (
            speculative_lines(speculative, model) if speculative else []):
        print(line, flush=True)
    print(f"Serving model '{name}' from {model_dir} at http://{args.host}:{args.port}/v1 (Ctrl-C to stop)",
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
