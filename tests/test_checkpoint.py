"""Mistral-native checkpoints (ML4_SPEC §2): round trip, shards, FP8 block scales (§2.2, §9.4) and load errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import full_forward, random_tokens
from hisparse.core.config import preset_params
from hisparse.model.tiny import random_model
from hisparse.model.linear import Linear, weight_dequant, weight_quant
from hisparse.model.weights import CheckpointError, from_checkpoint_name, load_model, save_model

pytestmark = pytest.mark.usefixtures("single_thread")
CKPT = "consolidated.safetensors"
E4M3_REL = 2.0 ** -4   # half an ulp of a 3-bit mantissa, relative to the value
E4M3_SUB = 2.0 ** -10  # half the subnormal spacing 2^-9, in units of the block scale


# ------------------------------------------------------------------------------------------ FP8 (§2.2)

def loop_dequant(w8: torch.Tensor, s: torch.Tensor, b: tuple[int, int]) -> torch.Tensor:
    """W[i, j] = fp8(W8[i, j]) * S[i // B0, j // B1], one block at a time."""
    w = torch.empty(w8.shape, dtype=torch.float32)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            rows, cols = slice(bi * b[0], (bi + 1) * b[0]), slice(bj * b[1], (bj + 1) * b[1])
            w[rows, cols] = w8[rows, cols].float() * s[bi, bj]
    return w


def test_fp8_block_round_trip_with_partial_edge_blocks(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(45, 37, generator=g) * torch.rand(45, 1, generator=g) * 0.1).bfloat16()
    w[:16, :16] = 0                                                        # an all-zero block
    block = (16, 16)
    w8, s = weight_quant(w, block)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (3, 3)                  # ceil(45/16), ceil(37/16): partial edges
    deq = weight_dequant(w8, s, block)
    assert torch.equal(deq, loop_dequant(w8, s, block))                    # multiply, per block
    scale_of = s.repeat_interleave(16, 0)[:45].repeat_interleave(16, 1)[:, :37]
    err = (deq - w.float()).abs()
    assert (err <= torch.maximum(E4M3_REL * w.float().abs(), E4M3_SUB * scale_of) * 1.0001).all()
    assert (deq[:16, :16] == 0).all()
    for bi, bj in ((2, 2), (0, 1), (1, 2)):                                # block amax maps to 448
        blk = w.float()[bi * 16:(bi + 1) * 16, bj * 16:(bj + 1) * 16]
        assert float(s[bi, bj]) == pytest.approx(float(blk.abs().max()) / 448, rel=1e-6)
    rel = float((deq - w.float()).norm() / w.float().norm())
    assert rel < 0.05
    # a loader that DIVIDES by the scale (the bug §2.2 warns about) is off by orders of magnitude
    divided = w8.float() / scale_of
    assert float((divided - w.float()).norm() / w.float().norm()) > 1e3


def test_dequantized_rows_reads_only_whole_blocks_of_each_group(seed: int) -> None:
    """Per-group row halves (the absorbed MLA's wkv_b nope / value rows) equal the slice of the whole dequantised
    weight, bit for bit, both when they are whole scale blocks (only those rows are dequantised) and when not."""
    g = torch.Generator().manual_seed(seed)
    for groups, size, block, part in ((3, 32, (16, 16), slice(0, 16)), (3, 32, (16, 16), slice(16, None)),
                                      (2, 24, (16, 16), slice(8, None)), (2, 24, (16, 16), slice(0, 8))):
        lin = Linear(40, groups * size)
        w8, s = weight_quant(torch.randn(groups * size, 40, generator=g), block)
        lin.to_fp8(w8, s, block)
        want = lin.dequantized(torch.float64).view(groups, size, 40)[:, part]
        got = lin.dequantized_rows(torch.float64, groups, part)
        assert got.shape == want.shape and torch.equal(got, want), (size, part)
    plain = Linear(40, 64).double()
    assert torch.equal(plain.dequantized_rows(torch.float64, 2, slice(0, 16)), plain.weight.view(2, 32, 40)[:, :16])


def test_fp8_checkpoint_loads_close_to_unquantised(tmp_path: Path, seed: int) -> None:
    model = random_model(preset_params("tiny"), seed)
    save_model(model, tmp_path, fp8_block=(16, 16))
    params = json.loads((tmp_path / "params.json").read_text())
    assert params["quantization"]["qformat_weight"] == "fp8_e4m3"
    assert params["quantization"]["weight_block_size"] == [16, 16]
    raw = load_file(str(tmp_path / CKPT))
    wq = "layers.1.attention.wq.weight"
    assert raw[wq].dtype == torch.float8_e4m3fn and raw[wq + ".qscale_weight"].shape == (6, 4)   # 96x64 / 16
    for never in ("norm.weight", "layers.1.gate.weight", "layers.0.attention.indexer.weights_proj.weight",
                  "tok_embeddings.weight", "output.weight", "lerope.alpha", "layers.3.attention.ssmax_scaling"):
        assert raw[never].dtype != torch.float8_e4m3fn and never + ".qscale_weight" not in raw
    loaded = load_model(tmp_path)
    ref = model.state_dict()
    for name, t in loaded.state_dict().items():   # FP8 weights and their scales as stored, the rest as saved
        disk = name.replace(".moe.", ".").replace(".weight_scale", ".weight.qscale_weight")
        if disk.endswith(".qscale_weight") or disk + ".qscale_weight" in raw:
            assert t.dtype == raw[disk].dtype and torch.equal(t, raw[disk]), name
        else:
            assert torch.equal(t, ref[name]), name
    # logits: 8 tokens = k keeps attention dense; past k the spec init's near-uniform indexer scores let fp8 noise
    # flip selections, which is legitimate and not what this checks
    tokens = random_tokens(8, 512, seed)
    a, _ = full_forward(model, tokens)
    b, _ = full_forward(loaded, tokens)
    err = float((a - b).norm() / a.norm())
    assert 0 < err < 0.15, f"fp8 checkpoint logits differ from unquantised by {err:.3e}"


# ------------------------------------------------------------------------------------------ round trip, shards

@pytest.fixture(scope="module")
def want() -> dict[str, torch.Tensor]:
    """The state of the model make_tiny(seed 0) saves."""
    return random_model(preset_params("tiny"), 0).state_dict()


def test_make_tiny_round_trip(tiny_ckpt: Path, want: dict) -> None:
    """make_tiny(seed 0) -> load_model is tensor-for-tensor the random_model it saved."""
    got = load_model(tiny_ckpt).state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads(tiny_ckpt: Path, tmp_path: Path, want: dict) -> None:
    d = copy_ckpt(tiny_ckpt, tmp_path / "sharded")
    tensors = load_file(str(d / CKPT))
    (d / CKPT).unlink()
    names = sorted(tensors)
    shards = {"consolidated-00001-of-00002.safetensors": names[::2],
              "consolidated-00002-of-00002.safetensors": names[1::2]}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(d / fname))
    weight_map = {n: f for f, part in shards.items() for n in part}
    (d / (CKPT + ".index.json")).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    got = load_model(d).state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy the checkpoint with its tensor dict edited in place by `edit`."""
    d = copy_ckpt(src, dst)
    tensors = load_file(str(d / CKPT))
    edit(tensors)
    save_file(tensors, str(d / CKPT))
    return d


def expect_error(d: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    for f in fragments:
        assert f in str(e.value), f"{f!r} not in {str(e.value)!r}"


@pytest.mark.parametrize("name", ["layers.3.attention.ssmax_scaling", "layers.4.attention.indexer.ssmax_scaling",
                                  "lerope.alpha", "output.weight", "layers.7.experts.5.w2.weight",
                                  "layers.3.attention.wkv_a_with_mqa.weight"])
def test_missing_tensor(name: str, tiny_ckpt: Path, tmp_path: Path) -> None:
    expect_error(rewrite(tiny_ckpt, tmp_path / "c", lambda t: t.pop(name)), "missing", f"'{name}'")


@pytest.mark.parametrize("name", ["layers.2.attention.indexer.wk.weight",      # a sharer has no indexer
                                  "layers.7.attention.wkv_a_with_mqa.weight",   # a KV consumer has no W_kva
                                  "layers.0.experts.0.w1.weight"])              # layer 0 is dense
def test_unexpected_tensor(name: str, tiny_ckpt: Path, tmp_path: Path) -> None:
    expect_error(rewrite(tiny_ckpt, tmp_path / "c", lambda t: t.__setitem__(name, torch.zeros(16, 64))),
                 "unexpected", f"'{name}'")


def test_wrong_shape(tiny_ckpt: Path, tmp_path: Path) -> None:
    name = "layers.5.attention.wq.weight"
    d = rewrite(tiny_ckpt, tmp_path / "c", lambda t: t.__setitem__(name, t[name][:-1].clone()))
    expect_error(d, f"'{name}'", "[95, 64]", "[96, 64]")


def test_fp8_tensor_without_qscale(tiny_ckpt: Path, tmp_path: Path) -> None:
    name = "layers.1.attention.wo.weight"
    d = rewrite(tiny_ckpt, tmp_path / "c", lambda t: t.__setitem__(name, t[name].float().to(torch.float8_e4m3fn)))
    expect_error(d, f"'{name}'", "qscale_weight")


def test_vision_tensors_are_skipped(tiny_ckpt: Path, tmp_path: Path, want: dict) -> None:
    extra = {"vision_encoder.transformer.layers.0.attention.wq.weight": torch.randn(8, 8),
             "vision_language_adapter.w_in.weight": torch.randn(8, 8),
             "patch_merger.merging_layer.weight": torch.randn(4, 4), "pre_mm_projector_norm.weight": torch.randn(8)}
    d = rewrite(tiny_ckpt, tmp_path / "c", lambda t: t.update(extra))
    got = load_model(d).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_drafter_tensors_skipped_without_mtp_block(tiny_ckpt: Path, tmp_path: Path, want: dict) -> None:
    """mtp_dspark.* tensors load into the drafter when params.json has `mtp`, and are skipped without it."""
    raw = load_file(str(tiny_ckpt / CKPT))
    assert any(n.startswith("mtp_dspark.") for n in raw)
    d = copy_ckpt(tiny_ckpt, tmp_path / "c")
    params = json.loads((d / "params.json").read_text())
    del params["mtp"]
    (d / "params.json").write_text(json.dumps(params))
    got = load_model(d).state_dict()
    assert not any(n.startswith("mtp_dspark.") for n in got)
    assert set(want) - set(got) == {n for n in want if n.startswith("mtp_dspark.")}
    assert all(torch.equal(got[n], want[n]) for n in got)


def test_checkpoint_names_are_mistral_native(tiny_ckpt: Path) -> None:
    """§2.1 names on disk: MoE tensors directly under layers.N., no 'moe.' level."""
    names = set(load_file(str(tiny_ckpt / CKPT)))
    for n in ("layers.1.gate.weight", "layers.1.experts.7.w3.weight", "layers.1.shared_experts.w2.weight",
              "layers.0.feed_forward.w1.weight", "layers.0.attention.indexer.k_norm.bias", "lerope.alpha",
              "layers.7.attention.wkv_b.weight", "layers.7.attention.indexer.wq_b.weight"):
        assert n in names, n
    assert not any(".moe." in n for n in names)
    assert from_checkpoint_name("layers.3.experts.2.w1.weight") == "layers.3.moe.experts.2.w1.weight"
