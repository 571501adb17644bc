"""Tiny random ML4 checkpoints (spec §1.2 init) for tests, benchmarks and the built-in serving model."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..core.config import ModelConfig, preset_params
from .ml4 import ML4
from .weights import checkpoint_dtype, save_model, to_checkpoint_name

BUILTIN_VERSION = "v2"   # v2: with DSpark drafter weights (mtp_dspark.*)


@torch.no_grad()
def init_weights(model: ML4, seed: int) -> ML4:
    """Spec init: SSMax s ~ U(0, 0.2), b ~ U(0.8, 1.2); lerope.alpha ~ N(0, 0.1^2); norm weights 1, LayerNorm
    bias 0; every other weight N(0, 0.02^2). Values are rounded to the checkpoint storage dtype so that a
    saved and reloaded model is identical to this one."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("ssmax_scaling"):
            v = torch.stack((torch.rand(p.shape[0], generator=g) * 0.2,
                             0.8 + 0.4 * torch.rand(p.shape[0], generator=g)), dim=1)
        elif name.endswith("lerope.alpha"):
            v = torch.randn(p.shape, generator=g) * 0.1
        elif "norm" in name:
            v = torch.zeros(p.shape) if name.endswith("bias") else torch.ones(p.shape)
        else:
            v = torch.randn(p.shape, generator=g) * 0.02
        p.copy_(v.to(checkpoint_dtype(to_checkpoint_name(name))).to(p.dtype))
    return model


def random_model(params: dict | ModelConfig, seed: int = 0) -> ML4:
    cfg = params if isinstance(params, ModelConfig) else ModelConfig.from_params(params)
    return init_weights(ML4(cfg), seed).eval()


def make_tiny(out: str | Path, preset: str = "tiny", fp8: bool = False, seed: int = 0,
              with_tokenizer: bool = True) -> Path:
    """Write a servable tiny checkpoint: params.json, consolidated.safetensors and tekken.json.

    With the tokenizer, vocab_size becomes the tokenizer's (131072) and max_position_embeddings 1M, so the
    checkpoint can serve text and long contexts; fp8 writes block-scaled fp8 linears ([16, 16] blocks).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    params = preset_params(preset)
    if with_tokenizer:
        from .tokenizer import vocab_size, write_tekken
        write_tekken(out)
        params["vocab_size"] = vocab_size(out)
        params["max_position_embeddings"] = 1 << 20
    model = random_model(params, seed)
    save_model(model, out, fp8_block=(16, 16) if fp8 else None)
    return out


def builtin_tiny() -> Path:
    """The built-in tiny checkpoint, generated on first use into the cache folder."""
    root = Path(os.environ.get("HISPARSE_CACHE", Path.home() / ".cache" / "hisparse"))
    path = root / f"tiny-{BUILTIN_VERSION}"
    if not (path / "consolidated.safetensors").exists():
        tmp = root / f".tiny-{BUILTIN_VERSION}-{os.getpid()}"
        make_tiny(tmp)
        tmp.rename(path) if not path.exists() else None
    return path
