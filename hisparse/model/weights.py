"""Mistral-native checkpoints: params.json + consolidated*.safetensors (single file or sharded with an index).

FP8 e4m3 weights carry a sibling `<name>.qscale_weight` [ceil(out/B), ceil(in/B)] and are dequantised at load by
*multiplying* each B x B block by its scale (spec §2.2). Model parameter names equal checkpoint names except that
MoE tensors live under `layers.N.moe.` in the module tree and under `layers.N.` on disk.
"""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .ml4 import ML4

SKIPPED_PREFIXES = ("vision_encoder.", "vision_language_adapter.", "patch_merger.", "pre_mm_projector_norm.")
DRAFTER_PREFIX = "mtp_dspark."   # loaded when params.json has an `mtp` block, skipped otherwise
DRAFT_SSMAX = re.compile(r"^mtp_dspark\.layers\.(\d+)\.attention\.ssmax_scaling$")
QSCALE = ".qscale_weight"
QSCALE_ACT = ".qscale_act"
_MOE = re.compile(r"^(layers\.\d+\.)moe\.")
_MOE_DISK = re.compile(r"^(layers\.\d+\.)(gate|experts|shared_experts)\.")
F32_TENSORS = re.compile(r"(ssmax_scaling|lerope\.alpha|^layers\.\d+\.gate\.weight|weights_proj\.weight)$")
NEVER_QUANTISED = re.compile(r"(norm|ssmax_scaling|lerope|\.gate\.|weights_proj|tok_embeddings|^output\.|"
                             r"^mtp_dspark\.)")   # the drafter is bf16 in the release (spec §2.1)


class CheckpointError(ValueError):
    """A checkpoint that does not match its params.json; the message names the tensor."""


def to_checkpoint_name(name: str) -> str:
    return _MOE.sub(r"\1", name)


def from_checkpoint_name(name: str) -> str:
    return _MOE_DISK.sub(r"\1moe.\2.", name)


def dequantize_fp8(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W[i, j] = float(W8[i, j]) * S[i // B0, j // B1] (edge blocks partial)."""
    out, inp = w8.shape
    s = scale.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return w8.float() * s


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled fp8 e4m3 (scale = block amax / 448) -> (W8, qscale_weight); inverse of dequantize_fp8."""
    out, inp = w.shape
    b0, b1 = block
    pad = torch.zeros(-(-out // b0) * b0, -(-inp // b1) * b1, dtype=torch.float32)
    pad[:out, :inp] = w.float()
    tiles = pad.view(pad.shape[0] // b0, b0, pad.shape[1] // b1, b1)
    scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
    w8 = (tiles / scale[:, None, :, None]).view_as(pad)[:out, :inp].to(torch.float8_e4m3fn)
    return w8, scale


class ShardedTensors:
    """Read-only view of consolidated*.safetensors (one file, several, or an index json's weight_map)."""

    def __init__(self, model_dir: Path):
        index = sorted(model_dir.glob("consolidated*.safetensors.index.json"))
        if index:
            weight_map = json.loads(index[0].read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in model_dir.glob("consolidated*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir}: no consolidated*.safetensors found")
        self.handles = {f: safe_open(model_dir / f, "pt") for f in files}   # opened once, read lazily
        self.where = {key: h for h in self.handles.values() for key in h.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def keys(self) -> Iterator[str]:
        return iter(self.where)

    def get(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)


def load_tensor(ckpt: ShardedTensors, name: str, block: tuple[int, int]) -> torch.Tensor:
    """One tensor in fp32, dequantised if it has a sibling qscale_weight."""
    t = ckpt.get(name)
    if name + QSCALE in ckpt:
        return dequantize_fp8(t, ckpt.get(name + QSCALE), block)
    if t.dtype == torch.float8_e4m3fn:
        raise CheckpointError(f"tensor '{name}' is fp8 but has no '{name}{QSCALE}'")
    return t.float()


def load_model(model_dir: str | Path, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> ML4:
    """Build ML4 from params.json and load every tensor it implies; errors name the offending tensor."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.load(model_dir)
    block = cfg.quantization.weight_block_size if cfg.quantization else (128, 128)
    ckpt = ShardedTensors(model_dir)
    model = ML4(cfg)
    skipped = SKIPPED_PREFIXES if model.mtp_dspark is not None else SKIPPED_PREFIXES + (DRAFTER_PREFIX,)
    for name in ckpt.keys():   # the drafter's optional per-layer SSMax (spec §5.2): present -> applied
        m = DRAFT_SSMAX.match(name)
        if m and model.mtp_dspark is not None and int(m[1]) < len(model.mtp_dspark.layers):
            model.mtp_dspark.layers[int(m[1])].attention.enable_ssmax()
    expected = {to_checkpoint_name(n): p for n, p in model.state_dict().items()}
    for name in ckpt.keys():
        base = name.removesuffix(QSCALE).removesuffix(QSCALE_ACT)
        if name.startswith(skipped) or (base != name and base in expected):
            continue
        if name not in expected:
            raise CheckpointError(f"unexpected tensor '{name}' (not implied by params.json)")
    state = {}
    for name, param in expected.items():
        if name not in ckpt:
            raise CheckpointError(f"missing tensor '{name}' (expected shape {list(param.shape)})")
        t = load_tensor(ckpt, name, block)
        if t.shape != param.shape:
            raise CheckpointError(f"tensor '{name}': shape {list(t.shape)}, expected {list(param.shape)}")
        state[from_checkpoint_name(name)] = t
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


def checkpoint_dtype(name: str) -> torch.dtype:
    """Storage dtype of a tensor in a release-style checkpoint (§2.1): f32 for router/SSMax/LeRoPE, else bf16."""
    return torch.float32 if F32_TENSORS.search(name) else torch.bfloat16


def save_model(model: ML4, model_dir: str | Path, fp8_block: tuple[int, int] | None = None,
               extra: dict[str, torch.Tensor] | None = None) -> None:
    """Write params.json + consolidated.safetensors; with fp8_block, linear weights become fp8 + qscale_weight."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    if fp8_block is not None:
        from dataclasses import replace
        from .config import QuantConfig
        cfg = replace(cfg, quantization=QuantConfig("fp8_e4m3", "BLOCK", tuple(fp8_block), "NO_SCALES"),
                      layers=cfg.layers)
    cfg.save(model_dir)
    out = {}
    for name, t in list(model.state_dict().items()) + list((extra or {}).items()):
        name = to_checkpoint_name(name)
        t = t.detach().cpu()
        if fp8_block is not None and t.dim() == 2 and not NEVER_QUANTISED.search(name):
            out[name], out[name + QSCALE] = quantize_fp8(t, fp8_block)
        else:
            out[name] = t.to(checkpoint_dtype(name)).contiguous()
    path = model_dir / "consolidated.safetensors"
    save_file(out, str(path))    # renames a private (0600) temporary file over `path`
    path.chmod(stat.S_IMODE((model_dir / "params.json").stat().st_mode))   # params.json's: 0666 less the umask
