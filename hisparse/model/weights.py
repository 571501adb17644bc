"""Mistral-native checkpoints: params.json + consolidated*.safetensors (single file or sharded with an index).

Weights stay in checkpoint precision: FP8 e4m3 weights with their sibling `<name>.qscale_weight`
[ceil(out/B), ceil(in/B)] load as FP8 `Linear`s (W = W8 * scale per B x B block, spec §2.2, applied inside the
matmul), bf16 tensors stay bf16 when the model computes in bf16. Loading streams: the model is built on the meta
device and each parameter is read by slice, cast and placed on its device before the next is read. Model parameter
names equal checkpoint names except that MoE tensors live under `layers.N.moe.` in the module tree and under
`layers.N.` on disk, and an FP8 weight's `weight_scale` is `weight.qscale_weight` on disk.
"""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from ..core.config import ModelConfig
from .linear import FP8, Linear, weight_quant
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
    name = _MOE.sub(r"\1", name)
    return name.removesuffix(".weight_scale") + ".weight" + QSCALE if name.endswith(".weight_scale") else name


def from_checkpoint_name(name: str) -> str:
    name = _MOE_DISK.sub(r"\1moe.\2.", name)
    return name.removesuffix(".weight" + QSCALE) + ".weight_scale" if name.endswith(".weight" + QSCALE) else name


class ShardedTensors:
    """Read-only view of consolidated*.safetensors (one file, several, or an index json's weight_map).

    Tensors are read by slice from the memory-mapped files (`safe_open(...).get_slice`): a read touches only the
    bytes of the region asked for, so a reader of part of a tensor (a tensor-parallel rank, an expert subset) reads
    that part."""

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

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].get_slice(name).get_shape())

    def read(self, name: str, region: Region | None = None) -> torch.Tensor:
        """The tensor, or only `region` of it (one slice per leading dim), on the host: a view of the file's
        private (copy-on-write) mapping where safetensors can give one, else a copy of the region."""
        view = self.where[name].get_slice(name)
        return view[region] if region else view[:]


Region = tuple[slice, ...]
# (model parameter name, its full checkpoint shape) -> the region of it to load (a slice per leading dim, steps
# of 1; FP8 weights block-aligned), or None for all of it. The loaded parameter has the region's shape.
Select = Callable[[str, tuple[int, ...]], "Region | None"]


def region_shape(region: Region | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    if not region:
        return shape
    for s in region:
        if s.step not in (None, 1):
            raise ValueError(f"region {region}: slices must have step 1")
    return tuple(len(range(*s.indices(n))) for s, n in zip(region, shape)) + shape[len(region):]


def scale_region(name: str, region: Region | None, shape: tuple[int, ...], block: tuple[int, int]) -> Region | None:
    """The block-scale rows/columns an FP8 weight region needs; its starts (and stops, but for the edge) must
    fall on block boundaries, so that the region's blocks are whole checkpoint blocks."""
    if not region:
        return None
    out = []
    for s, n, b in zip(region, shape, block):
        start, stop, _ = s.indices(n)
        if start % b or (stop % b and stop != n):
            raise CheckpointError(f"tensor '{name}': region {region} is not aligned to its fp8 blocks {list(block)}")
        out.append(slice(start // b, -(-stop // b)))
    return tuple(out)


def held_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """Dtype a plain (non-FP8) checkpoint tensor is held in when the model computes in `dtype`: the spec's fp32
    tensors (router, SSMax, LeRoPE, indexer head weights) never below fp32, every other in `dtype` (bf16 stays
    bf16 under bf16; float32/float64 are the exactness and training modes)."""
    return torch.promote_types(torch.float32, dtype) if F32_TENSORS.search(name) else dtype


def load_weights(model: nn.Module, ckpt: ShardedTensors, block: tuple[int, int], device: torch.device | str,
                 dtype: torch.dtype, select: Select | None = None, progress: bool = True) -> None:
    """Fill every parameter of `model` (built on the meta device, so nothing is allocated twice) from `ckpt`, one
    tensor region at a time: read by slice, cast to its held dtype and placed on `device` before the next is read.
    Tensors with a `.qscale_weight` stay FP8 (their `Linear` takes weight + block scales). Host memory beyond what
    the model holds on the host peaks at about one region and its cast. Errors name the tensor."""
    params = list(model.named_parameters())
    total = sum(p.numel() for _, p in params)
    with tqdm(total=total, unit="param", unit_scale=True, desc="loading weights", disable=None if progress else True,
              leave=False) as bar:
        for pname, param in params:
            name = to_checkpoint_name(pname)
            if name not in ckpt:
                raise CheckpointError(f"missing tensor '{name}' (expected shape {list(param.shape)})")
            shape = ckpt.shape(name)
            region = select(pname, shape) if select else None
            got = region_shape(region, shape)
            if got != tuple(param.shape):
                raise CheckpointError(f"tensor '{name}': shape {list(got)}, expected {list(param.shape)}")
            owner, _, attr = pname.rpartition(".")
            module = model.get_submodule(owner)
            t = ckpt.read(name, region)
            if name + QSCALE in ckpt:
                if not (isinstance(module, Linear) and attr == "weight") or t.dtype != FP8:
                    raise CheckpointError(f"tensor '{name}' ({t.dtype}) has a '{QSCALE}' but is not an fp8 "
                                          "linear weight")
                scale = ckpt.read(name + QSCALE, scale_region(name, region, shape, block))
                try:
                    module.to_fp8(t.to(device), scale.to(device=device, dtype=torch.float32), block)
                except ValueError as e:
                    raise CheckpointError(f"tensor '{name}': {e}") from None
            elif t.dtype == FP8:
                raise CheckpointError(f"tensor '{name}' is fp8 but has no '{name}{QSCALE}'")
            else:
                module.register_parameter(attr, nn.Parameter(t.to(device=device, dtype=held_dtype(name, dtype)),
                                                             requires_grad=param.requires_grad))
            del t
            bar.update(param.numel())


def load_model(model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               shard: Callable[[ML4], Select | None] | None = None, progress: bool = True) -> ML4:
    """Build ML4 from params.json and stream in every tensor it implies (see `load_weights`); errors name the
    offending tensor. `shard` narrows the meta-device model to one rank's share and returns the region of each
    parameter to load (`hisparse.parallel.tp`)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.load(model_dir)
    block = cfg.quantization.weight_block_size if cfg.quantization else (128, 128)
    ckpt = ShardedTensors(model_dir)
    with torch.device("meta"):
        model = ML4(cfg)
    skipped = SKIPPED_PREFIXES if model.mtp_dspark is not None else SKIPPED_PREFIXES + (DRAFTER_PREFIX,)
    for name in ckpt.keys():   # the drafter's optional per-layer SSMax (spec §5.2): present -> applied
        m = DRAFT_SSMAX.match(name)
        if m and model.mtp_dspark is not None and int(m[1]) < len(model.mtp_dspark.layers):
            model.mtp_dspark.layers[int(m[1])].attention.enable_ssmax()
    expected = {to_checkpoint_name(n) for n, _ in model.named_parameters()}
    for name in ckpt.keys():
        base = name.removesuffix(QSCALE).removesuffix(QSCALE_ACT)
        if name.startswith(skipped) or (base != name and base in expected):
            continue
        if name not in expected:
            raise CheckpointError(f"unexpected tensor '{name}' (not implied by params.json)")
    select = shard(model) if shard is not None else None
    load_weights(model, ckpt, tuple(block), device, dtype, select, progress)
    return model.eval()


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
        from ..core.config import QuantConfig
        cfg = replace(cfg, quantization=QuantConfig("fp8_e4m3", "BLOCK", tuple(fp8_block), "NO_SCALES"),
                      layers=cfg.layers)
    cfg.save(model_dir)
    out = {}
    for name, t in list(model.state_dict().items()) + list((extra or {}).items()):
        name = to_checkpoint_name(name)
        t = t.detach().cpu()
        if t.dtype == FP8 or name.endswith(QSCALE):   # an FP8 linear of a loaded model: as it was stored
            out[name] = t.contiguous()
        elif fp8_block is not None and t.dim() == 2 and not NEVER_QUANTISED.search(name):
            out[name], out[name + QSCALE] = weight_quant(t, fp8_block)
        else:
            out[name] = t.to(checkpoint_dtype(name)).contiguous()
    path = model_dir / "consolidated.safetensors"
    save_file(out, str(path))    # renames a private (0600) temporary file over `path`
    path.chmod(stat.S_IMODE((model_dir / "params.json").stat().st_mode))   # params.json's: 0666 less the umask
