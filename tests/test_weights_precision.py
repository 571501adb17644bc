"""Weights in checkpoint precision and streaming loading: FP8 linears stay FP8 (block-scaled matmul), bf16 stays bf16
under --dtype bfloat16, logits equal the dequantise-at-load path in fp32, regions load by slice, and loading's
peak host memory is a tensor, not the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import full_forward, random_tokens
from hisparse.model import linear
from hisparse.core.config import ModelConfig
from hisparse.model.linear import FP8, Linear, weight_quant
from hisparse.model.ml4 import ML4
from hisparse.model.tiny import make_tiny
from hisparse.model.weights import (QSCALE, CheckpointError, ShardedTensors, from_checkpoint_name, load_model,
                                    load_weights)

pytestmark = pytest.mark.usefixtures("single_thread")
ROOT = Path(__file__).resolve().parents[1]
CKPT = "consolidated.safetensors"


def loop_dequant(w8: torch.Tensor, s: torch.Tensor, b: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """W[i, j] = W8[i, j] * S[i // B0, j // B1] in `dtype`, one block at a time (independent of linear.py)."""
    w = torch.empty(w8.shape, dtype=dtype)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            rows, cols = slice(bi * b[0], (bi + 1) * b[0]), slice(bj * b[1], (bj + 1) * b[1])
            w[rows, cols] = w8[rows, cols].to(dtype) * s[bi, bj].to(dtype)
    return w


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("fp8"), fp8=True, with_tokenizer=False)


# ------------------------------------------------------------------------------------------ the FP8 linear

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp8_linear_tiles_equal_the_block_dequantised_weight(dtype: torch.dtype, seed: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of whole block rows (several, the last one partial) give x W^T with W = W8 * S per block."""
    g = torch.Generator().manual_seed(seed)
    w8, s = weight_quant(torch.randn(45, 37, generator=g) * 0.1, (16, 16))
    lin = Linear(37, 45)
    lin.to_fp8(w8, s, (16, 16))
    x = torch.randn(5, 37, generator=g, dtype=dtype)
    want = F.linear(x, loop_dequant(w8, s, (16, 16), dtype))
    assert torch.allclose(lin(x), want, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)
    monkeypatch.setattr(linear, "DEQUANT_TILE_ELEMS", 16 * 37)        # one block row per tile: 3 tiles
    tiled = lin(x)
    assert torch.allclose(tiled, want, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)
    assert not torch.allclose(tiled, F.linear(x, loop_dequant(w8, s.roll(1, 0), (16, 16), dtype)), rtol=1e-2)
    assert lin.weight.dtype == FP8 and not lin.weight.requires_grad


def test_to_fp8_rejects_a_wrong_scale_shape() -> None:
    w8, s = weight_quant(torch.randn(45, 37), (16, 16))
    with pytest.raises(ValueError, match="scale"):
        Linear(37, 45).to_fp8(w8, s[:2], (16, 16))


# ------------------------------------------------------------------------------------------ loading in precision

def stored(raw: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return raw[name.replace(".moe.", ".").replace(".weight_scale", ".weight" + QSCALE)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_checkpoint_keeps_weights_as_stored(fp8_ckpt: Path, dtype: torch.dtype) -> None:
    """Every FP8 tensor is an FP8 parameter with its fp32 block scales, bit-equal to the file; under bf16 every
    other tensor keeps its stored dtype too (bf16, or fp32 for router/SSMax/LeRoPE); nothing is held in fp32 that
    is FP8 on disk."""
    raw = load_file(str(fp8_ckpt / CKPT))
    model = load_model(fp8_ckpt, dtype=dtype)
    fp8_linears = [m for m in model.modules() if isinstance(m, Linear) and m.fp8]
    assert len(fp8_linears) == sum(1 for n in raw if n.endswith(QSCALE)) > 50
    for name, p in model.named_parameters():
        disk = stored(raw, name)
        if disk.dtype == FP8 or name.endswith("weight_scale"):
            assert p.dtype == disk.dtype and torch.equal(p.view(torch.uint8) if p.dtype == FP8 else p,
                                                         disk.view(torch.uint8) if disk.dtype == FP8 else disk), name
        elif dtype == torch.bfloat16:
            assert p.dtype == disk.dtype and torch.equal(p, disk), name
        else:
            assert p.dtype == torch.float32 and torch.equal(p, disk.float()), name
    assert model.dtype == dtype


def dequantised_reference(ckpt: Path, dtype: torch.dtype) -> ML4:
    """The previous loader's model: every FP8 weight dequantised to fp32 at load (block loop), then the whole
    model cast to `dtype`."""
    raw = load_file(str(ckpt / CKPT))
    state = {}
    for name, t in raw.items():
        if name.endswith(QSCALE):
            continue
        w = loop_dequant(t, raw[name + QSCALE], (16, 16), torch.float32) if name + QSCALE in raw else t.float()
        state[from_checkpoint_name(name)] = w
    model = ML4(ModelConfig.load(ckpt))
    model.load_state_dict(state)
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp8_logits_equal_the_dequantise_at_load_path(fp8_ckpt: Path, dtype: torch.dtype, seed: int) -> None:
    tokens = random_tokens(48, 512, seed)
    got, trace = full_forward(load_model(fp8_ckpt, dtype=dtype), tokens)
    want, want_trace = full_forward(dequantised_reference(fp8_ckpt, dtype), tokens)
    err = float((got - want).abs().max() / want.abs().max())
    print(f"[seed {seed}] {dtype}: FP8-in-the-matmul vs dequantise-at-load, max relative logit error {err:.2e}")
    assert got.dtype == want.dtype and err < 1e-5
    # the comparison can fail: a scale off by one block row moves the logits far beyond that
    bad = load_model(fp8_ckpt, dtype=dtype)
    bad.layers[1].attention.wq.weight_scale.data = bad.layers[1].attention.wq.weight_scale.data.roll(1, 0)
    wrong, _ = full_forward(bad, tokens)
    assert float((wrong - want).abs().max() / want.abs().max()) > 1e-3


def test_bfloat16_target_and_drafter_decode(fp8_ckpt: Path, seed: int) -> None:
    """Under bf16 the FP8 target and its bf16 DSpark drafter decode speculatively (the Markov head's state in the
    drafter's dtype, logits in fp32)."""
    from hisparse.engine.speculative import SpeculativeConfig, SpeculativeDecoder
    from hisparse.model.dspark import DSparkDrafter
    from hisparse.kv.resident import ResidentKV
    model = load_model(fp8_ckpt, dtype=torch.bfloat16)
    dec = SpeculativeDecoder(model, ResidentKV(model.cfg, None, dtype=model.dtype), DSparkDrafter(model),
                             SpeculativeConfig("dspark", 3, "greedy"))
    st = dec.start(0, random_tokens(20, 512, seed).tolist())
    out = [t for _ in range(4) for t in dec.step(st, 4)]
    assert 4 <= len(out) <= 16 and all(0 <= t < 512 for t in out)


# ------------------------------------------------------------------------------------------ regions

def test_select_loads_only_the_asked_region(fp8_ckpt: Path) -> None:
    """A model with a half-width wq (as a tensor-parallel rank would build it) and half the embedding rows loads
    exactly those regions of the file, FP8 scales included; a region off the block grid is refused by name."""
    raw = load_file(str(fp8_ckpt / CKPT))
    cfg = ModelConfig.load(fp8_ckpt)
    wq = "layers.1.attention.wq.weight"
    regions = {wq: (slice(48, 96),), "tok_embeddings.weight": (slice(0, 256),)}

    def build() -> ML4:
        with torch.device("meta"):
            model = ML4(cfg)
            model.layers[1].attention.wq = Linear(cfg.dim, 48)
            model.tok_embeddings = torch.nn.Embedding(256, cfg.dim)
        return model

    model = build()
    load_weights(model, ShardedTensors(fp8_ckpt), (16, 16), "cpu", torch.bfloat16, select=lambda n, s: regions.get(n))
    got = model.layers[1].attention.wq
    assert got.weight.dtype == FP8 and torch.equal(got.weight.view(torch.uint8), raw[wq][48:96].view(torch.uint8))
    assert torch.equal(got.weight_scale, raw[wq + QSCALE][3:6])
    assert torch.equal(model.tok_embeddings.weight, raw["tok_embeddings.weight"][:256])
    assert torch.equal(model.layers[2].attention.wo.weight_scale, raw["layers.2.attention.wo.weight" + QSCALE])
    regions[wq] = (slice(40, 88),)
    with pytest.raises(CheckpointError, match=f"tensor '{wq}'.*not aligned"):
        load_weights(build(), ShardedTensors(fp8_ckpt), (16, 16), "cpu", torch.bfloat16,
                     select=lambda n, s: regions.get(n))
    regions[wq] = (slice(0, 32),)
    with pytest.raises(CheckpointError, match=rf"tensor '{wq}': shape \[32, 64\], expected \[48, 64\]"):
        load_weights(build(), ShardedTensors(fp8_ckpt), (16, 16), "cpu", torch.bfloat16,
                     select=lambda n, s: regions.get(n))


# ------------------------------------------------------------------------------------------ peak host memory

@pytest.mark.slow
def test_streaming_load_peak_memory(tmp_path: Path) -> None:
    """A ~400 MB FP8 checkpoint (128 x 128 blocks) loads in a fresh process with a peak RSS above the pre-load
    baseline far below the checkpoint: no second copy of the model, no fp32 copy of an FP8 weight, in loading or
    in a forward (an fp32 copy of the FP8 weights alone would be ~1.4 GB)."""
    from benchmarks.weights.load_memory import probe, tensor_sizes, write_checkpoint
    ckpt = write_checkpoint(tmp_path / "ckpt", experts=16, expert_hidden=2048)
    size, largest = tensor_sizes(ckpt)
    assert size > 350e6
    raw_fp8 = sum(t.numel() for n, t in load_file(str(ckpt / CKPT)).items() if t.dtype == FP8)
    for dtype in ("bfloat16", "float32"):
        r = probe(ckpt, dtype, forward=True)
        print(f"{dtype}: checkpoint {size / 2**20:.0f} MiB (largest tensor {largest / 2**20:.1f} MiB), parameters "
              f"{r['param_bytes'] / 2**20:.0f} MiB, load peak {r['load_peak'] / 2**20:.0f} MiB, forward peak "
              f"{r['forward_peak'] / 2**20:.0f} MiB above baseline")
        assert "float8_e4m3fn" in r["dtypes"] and (dtype == "float32") == ("bfloat16" not in r["dtypes"])
        # beyond the tensors held as converted copies (float32: every non-FP8 one): the file pages read for them,
        # the process's fixed costs and one tensor in flight; a second copy of the model would be > `size`
        cast = r["param_bytes"] - raw_fp8 - (size - raw_fp8) * (dtype == "bfloat16")
        assert r["load_peak"] < max(cast, 0) + size / 4, r
        assert r["forward_peak"] < r["param_bytes"] + size / 4, r


# ------------------------------------------------------------------------------------------ serving in bf16

@pytest.mark.slow
def test_serve_bfloat16_agrees_with_float32(tmp_path: Path) -> None:
    """`hisparse serve --dtype bfloat16` serves the FP8 tiny checkpoint (real servers, greedy completions); its
    per-token agreement with fp32 on the same contexts is reported and must be a majority."""
    from benchmarks.weights.bf16_agreement import measure
    ckpt = make_tiny(tmp_path / "tiny-fp8", fp8=True, seed=0)
    r = measure(ckpt, n_prompts=8, max_tokens=16, seed=0, workdir=tmp_path)
    print(json.dumps(r))
    assert "(bfloat16 on cpu)" in (tmp_path / "serve-bfloat16.log").read_text()
    assert r["tokens"] == 8 * 16
    assert r["teacher_forced"] > 0.5, r
